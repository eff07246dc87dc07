"""The only code that imports ``llama_cpp``: every C call, return-code check, buffer growth and
log capture of lcgen. Nothing above this package sees ctypes; nothing here knows lcgen's
higher-level types.

- :mod:`~lcgen._native.log`: backend set-up, llama.cpp's log routed into lcgen's errors.
- :mod:`~lcgen._native.model`: an owned ``llama_model`` and its vocabulary calls.
- :mod:`~lcgen._native.context`: an owned ``llama_context``, its batch and its memory.
- :mod:`~lcgen._native.grammar`: llama.cpp's GBNF grammar sampler.
"""
