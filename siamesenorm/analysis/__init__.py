"""Reading trained models and runs: the checkpoint probes of the paper's section 5 (probes), the paper's tables
(tables) and the figures (figures).

May import: siamesenorm.run, siamesenorm.models and below.
"""
