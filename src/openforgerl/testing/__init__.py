"""Fakes and scripted engines for tests and benchmarks, never the product's default path.

- `ScriptedEngine` (scripted_engine.py): an Engine whose outputs come from a list or a callback,
  with no model and no latency unless asked for.
- `fake_sglang_app` (fake_sglang.py): a FAKE SGLang HTTP server (Starlette) that speaks SGLang's
  native wire format and delegates generation to any Engine, to test the SGLang client without SGLang.
"""
