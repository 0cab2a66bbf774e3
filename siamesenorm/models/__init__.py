"""The models: the model config (MODEL_TYPE and every variant's knobs), the one registry from MODEL_TYPE to block,
the builder, and the glue that makes ai2-olmo 0.6.0 build our blocks (the import hook, the patch).

May import: siamesenorm.nn, siamesenorm.variants (and torch, ai2-olmo). Nothing of the run layer or the tools.
"""
