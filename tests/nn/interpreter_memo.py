"""Imported first by the processes that run the Triton kernels in Triton's interpreter (tests/nn/test_fused.py).

The interpreter patches ``triton.language`` for interpretation (``triton.runtime.interpreter._patch_lang``) on every
kernel launch and on every call of one jit function from another (the kernels call ``_rstd`` and ``_norm_backward``
dozens of times a launch): each time a scan of the modules' members, which after the first time patches nothing (the
members it replaced are no longer builtins). Importing this module makes it patch once for each jit function. The
kernels run as before (every check compares them with the references: a wrong patch would show as mismatches); measured
on 72 of ``stream_input``'s combinations, 22.4 s of CPU in one process before, 13.7 s after."""
try:
    from triton.runtime import interpreter as _interpreter
except ImportError:  # no Triton on the path: nothing to patch
    _interpreter = None

INSTALLED = _interpreter is not None and hasattr(_interpreter, "_patch_lang")
if INSTALLED:
    _patch_lang = _interpreter._patch_lang
    _patched = set()  # the Python functions under the jit functions patched for

    def _patch_once(fn):
        if fn not in _patched:
            _patch_lang(fn)  # (raises as it would for a function that does not see triton.language)
            _patched.add(fn)

    _interpreter._patch_lang = _patch_once
