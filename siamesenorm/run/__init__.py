"""The run layer: what makes one training run trustworthy whichever framework trains it: the recipe and its checks
(recipe, recipe_keys), the run folder (one run per folder, the rerun rules, the data fingerprint), the run record
and metrics lines (records), the divergence guard (stability), the console, token files (data), and the loader of
files from elsewhere (safeload, checkpoints).

May import: siamesenorm.models and below. Never a framework adapter (ai2_olmo, olmo_core) or a tool.
"""
