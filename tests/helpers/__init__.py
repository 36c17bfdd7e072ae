"""What the tests share: tiny models (:mod:`.models`), tiny data and data files (:mod:`.data`), the test Trainer and
a recording logger (:mod:`.trainers`), callbacks that stop a run at a chosen step (:mod:`.callbacks`), one in-process
and one subprocess command-line runner (:mod:`.cli`), gloo groups (:mod:`.distributed`) and the bit-equal resume
check (:mod:`.resume`)."""
