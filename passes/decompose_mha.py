"""Placeholder filled below."""
def decompose_attention_modules(gm, example_inputs=None, *, config):
    return gm
