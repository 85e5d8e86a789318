"""The browser target: web/ (the JS runtime) and gpt2edge/convert/web.py, under node and headless Chromium."""
