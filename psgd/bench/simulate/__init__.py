"""``psgd bench simulate``: a discrete-event simulation of a psgd job, its costs measured on the machine at hand
(:mod:`.calibrate`), its clock and resources (:mod:`.engine`), the job as psgd runs it (:mod:`.job`) and the
command (:mod:`.command`)."""
