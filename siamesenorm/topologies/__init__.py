"""One module per residual topology; each module's docstring gives its update rule."""
