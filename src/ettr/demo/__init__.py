"""`ettr demo`, an application built on ettr (docs/demo.md): the shipped reference DLRM job run twice with the
same failures, baseline vs optimized, and the story of the gain.

    app.py       the command: both jobs (the baseline seeds the compile store), requeue, publishing, the report
    progress.py  what each job is doing, read from its ledger, and the progress display
    story.py     the story from the two run directories (pure over their reports): technique shares of the
                 gain, TTS steps, TTR by bucket, init audits, the simulator's replay and fleet projection
    render.py    that story as terminal lines and report.html sections
    explain.py   where the two runs differ, bucket by bucket, as text
    _examples/   the reference job (`dlrm`, a link to the repository's examples/dlrm), shipped in the wheel

The library never imports this package; `ettr.cli` runs `ettr.demo.app.main`.
"""
