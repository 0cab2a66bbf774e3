"""The CPU studies: the sweep driver (sweep: cells of a plan, run and recorded one by one), the learning-rate grid
study's report (lr_grid) and the depth and training-dynamics study of the paper's second version
(depth_and_dynamics).

May import: siamesenorm.analysis, siamesenorm.run and below.
"""
