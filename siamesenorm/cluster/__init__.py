"""Running on a cluster: the preflight (will this recipe fit and how long will it take), the Slurm script writer
and the GPU check.

May import: siamesenorm.perf, siamesenorm.ai2_olmo, siamesenorm.run and below.
"""
