"""Cost: the GPU cost model counted on the meta device (costmodel) and the measured benchmark (benchmark).

May import: siamesenorm.run, siamesenorm.models and below.
"""
