"""The vision half of LLaVA-style models: a CLIP vision tower that turns pixels into patch features
(`clip.ClipVisionTower`) and the projector that maps them into the text model's embedding space
(`projector.LlavaProjector`). Both take transformers' checkpoint names through `Piece`s, as the
decoder families do; they run once per image, outside the paged KV cache."""
