"""The reference DLRM job that `ettr demo` runs, shipped inside the package so that the demo works from any
install of ettr (a wheel too). `dlrm` here is a link to the repository's `examples/dlrm`: one copy of the
job, which the wheel build copies in. Nothing imports it; the demo runs `dlrm/train.py` as a script."""
