// Drive headless Chromium (Debian's /usr/bin/chromium, never a downloaded build) through page loads:
//   node test/browser.mjs [--screenshot FILE] [--timeout MS] [--width W] [--form JSON] URL [URL ...]
// --form {"id": value, ...}: as a user would, fill the page's fields, click Generate, wait until it is done.
// Each URL loads in a fresh tab of one browser with a fresh profile; the tab is done when the page sets
// window.gpt2edge.done (after it has POSTed its report). One JSON line per URL on stdout:
//   {"url", "done", "console": [...], "error"?}
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import puppeteer from "puppeteer-core";

const args = process.argv.slice(2);
const opt = { timeout: 120000, screenshot: null, width: 1000, executable: process.env.CHROMIUM ?? "/usr/bin/chromium" };
const urls = [];
for (let i = 0; i < args.length; i++) {
  if (args[i] === "--timeout") opt.timeout = Number(args[++i]);
  else if (args[i] === "--screenshot") opt.screenshot = args[++i];
  else if (args[i] === "--width") opt.width = Number(args[++i]);
  else if (args[i] === "--form") opt.form = JSON.parse(args[++i]);
  else urls.push(args[i]);
}

const profile = mkdtempSync(join(tmpdir(), "gpt2edge-chromium-"));
const browser = await puppeteer.launch({
  executablePath: opt.executable,
  headless: true,
  userDataDir: profile,
  args: [
    "--headless", "--no-sandbox", "--disable-background-networking", "--disable-component-update",
    "--no-first-run", "--disable-sync", "--disable-dev-shm-usage",
    // WEBGPU=swiftshader: Chromium's software WebGPU adapter (slow, but the WebGPU path runs); else no GPU at all
    ...(process.env.WEBGPU === "swiftshader"
      ? ["--enable-unsafe-webgpu", "--use-webgpu-adapter=swiftshader", "--use-angle=swiftshader", "--enable-features=Vulkan"]
      : ["--disable-gpu"]),
  ],
});
try {
  for (const url of urls) {
    const page = await browser.newPage();
    await page.setViewport({ width: opt.width, height: 760 });
    const log = [];
    page.on("console", (m) => log.push(`${m.type()}: ${m.text()}`));
    page.on("pageerror", (e) => log.push(`pageerror: ${e.message}`));
    const out = { url, done: false, console: log };
    try {
      await page.goto(url, { waitUntil: "load", timeout: opt.timeout });
      await page.waitForFunction("window.gpt2edge?.done === true || window.gpt2edgeFailed === true", { timeout: opt.timeout, polling: 100 });
      if (opt.form) {
        for (const [id, value] of Object.entries(opt.form)) {
          await page.$eval(`#${id}`, (el, v) => (el.value = v), String(value));
        }
        await page.click("#generate");
        await page.waitForFunction(() => /^(done|error)/.test(document.getElementById("status").textContent), { timeout: opt.timeout, polling: 50 });
        out.stopDisabled = await page.$eval("#stop-button", (b) => b.disabled);
      }
      out.done = true;
      out.state = await page.evaluate(() => ({
        notes: window.gpt2edge?.notes ?? [],
        error: document.getElementById("error").hidden ? null : document.getElementById("error").textContent,
        output: document.getElementById("output-text").textContent,
        backend: document.getElementById("backend").textContent,
        crossOriginIsolated: globalThis.crossOriginIsolated,
      }));
      if (opt.screenshot) await page.screenshot({ path: opt.screenshot, fullPage: true });
    } catch (e) {
      out.error = String(e.message ?? e).split("\n")[0];
      if (opt.screenshot) await page.screenshot({ path: opt.screenshot, fullPage: true }).catch(() => {});
    }
    console.log(JSON.stringify(out));
    await page.close();
  }
} finally {
  await browser.close();
  rmSync(profile, { recursive: true, force: true });
}
