"""What the GPU suite (tests/gpu) and the benchmark (bench/) share, so that the benchmark
measures the server and the models the suite verified. One module per job:

- ``tiny_models``     the suite's random models (llama, deepseek, kimi) and the DeepseekV3
                      config the benchmark builds too; ``kimi_processor`` is copied into the
                      tiny kimi's directory (SGLang loads it from there as remote code).
- ``reference``       HF's float32 forward, the hidden states every file is compared with,
                      and relative errors.
- ``checks``          tolerances and checks as functions of files, logs and numbers.
- ``server``          the one launcher of the patched SGLang server: command line, start,
                      stop, HTTP calls.

Imported as ``testing.<module>`` with the repository root on ``sys.path`` (pytest run from
the root, ``python -m bench``, the device's PYTHONPATH). It imports neither ``bench`` nor
``tests``, and is not shipped: pyproject's package list is ``sglang_ext*`` only.
"""
