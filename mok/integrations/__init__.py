"""MoK inside other libraries.

- :mod:`mok.integrations.transformers`: MoK as a Hugging Face transformers experts backend
  (``from_pretrained(..., experts_implementation="mok")`` after ``import mok.integrations.transformers``,
  or ``mok.integrations.transformers.apply(model)``); needs the ``hf`` extra (``pip install 'mok[hf]'``).

Nothing is imported here: each integration imports its library when it is imported itself.
"""
