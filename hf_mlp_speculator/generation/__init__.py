"""How `generate()` runs speculative decoding: the one hook (`mixin`), the package's decoding loop and the way into
transformers' own, which cache a call decodes on, what a call is refused for, and transformers' private touchpoints."""
