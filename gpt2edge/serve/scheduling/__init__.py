"""The scheduler thread and what it schedules: jobs, batches (fixed or continuous), request plans, per-row text."""
