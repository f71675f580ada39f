"""Renderers of an `EttReport`: `text` (terminal), `json` (the contract's `ettr.report/1`), `html` (charts).

`load` reads a run directory into a report (the I/O half of `ettr report`). Importing this package loads
no renderer; import the one you need: `from ettr.report.text import render`.
"""
