"""The simulated accelerator: measured step costs in place of the forward pass.

``cost_model`` (the fitted step-time form) -> ``profile`` (a JSON file: hardware,
model, fit, residuals, raw points; shipped ones by name) -> ``measure`` (how
``kvxfer profile`` times the embedded engine) -> ``link`` (the P/D link: bytes
over a modelled NIC, FIFO per NIC) -> ``pool`` (the scaled-down, verifiable KV
pool a simulated worker registers) -> ``devices`` (modelled devices that workers
share, processor sharing) -> ``runtime`` (the engine core whose step
sleeps for the modelled time). Everything else a simulated worker runs is the
real serving stack. See docs/simulate.md.
"""
