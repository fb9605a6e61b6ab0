"""The emulated backend: calibrated iteration times instead of a model.

* `hardware.py` — GPU, model and link specs, each constant with its source (docs/calibration.md);
* `costmodel.py` — per-iteration constants derived from them and the iteration-time formulas;
* `backend.py` — `EmulatedBackend`, which waits the modelled duration of each step.
"""
