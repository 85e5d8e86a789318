"""The aarch64 lane (docs/arm.md): cpu_facts, the parity rule, the lane's own checks."""
