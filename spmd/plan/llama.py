"""The models the planner knows by name: Llama 3 and GPT shapes of ``spmd.testing.llama``'s decoder.

The decoder itself (``Llama``, ``LlamaConfig``, its tensor-parallel ``tp_plan``) lives in
spmd.testing.llama, where tests use it too; this module names its presets.
"""

from __future__ import annotations

from spmd.testing.llama import Llama, LlamaConfig, tp_plan

__all__ = ["LlamaConfig", "Llama", "LLAMA_PRESETS", "GPT_PRESETS", "tp_plan"]

LLAMA_PRESETS: dict[str, LlamaConfig] = {
    "debug": LlamaConfig(layers=4, dim=256, heads=8, kv_heads=4, ffn_dim=688, vocab=2048),
    "1b": LlamaConfig(layers=16, dim=2048, heads=32, kv_heads=8, ffn_dim=8192, vocab=128256),
    "8b": LlamaConfig(layers=32, dim=4096, heads=32, kv_heads=8, ffn_dim=14336, vocab=128256),
    "70b": LlamaConfig(layers=80, dim=8192, heads=64, kv_heads=8, ffn_dim=28672, vocab=128256),
    "405b": LlamaConfig(layers=126, dim=16384, heads=128, kv_heads=8, ffn_dim=53248, vocab=128256),
}
"""Llama 3 shapes (the 1B is Llama 3.2's; ``debug`` is a tiny one for tests and this machine)."""

GPT_PRESETS: dict[str, LlamaConfig] = {
    "demo": LlamaConfig(layers=4, dim=256, heads=8, kv_heads=8, ffn_dim=1024, vocab=2048, gated=False),
    "7b": LlamaConfig(layers=32, dim=4096, heads=32, kv_heads=32, ffn_dim=16384, vocab=32000, gated=False),
}
"""GPT shapes: multi-head attention and a 4x GELU MLP."""
