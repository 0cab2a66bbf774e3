"""The ai2-olmo 0.6.0 adapter: a run through OLMo's own Trainer (train: the run from start to record; trainer: the
hooks into OLMo's Trainer: metrics, the guard, the loss).

May import: siamesenorm.run, siamesenorm.models and below. Not siamesenorm.olmo_core (the two adapters sit side by
side) and not the tools.
"""
