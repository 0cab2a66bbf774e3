"""Exports to Hugging Face transformers (hf; check: an export from elsewhere checked before loading; remote: the
modelling code an export carries) and evaluation of a checkpoint (evaluate).

May import: siamesenorm.run, siamesenorm.models and below; remote/ itself imports only torch and transformers.
"""
