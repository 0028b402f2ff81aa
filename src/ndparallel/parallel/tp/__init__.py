"""Tensor parallelism (+ sequence parallel, loss parallel) on the ``tp`` mesh: ``tensor`` applies the
model's plan, ``styles`` holds the DTensor styles beyond torch's, ``lora`` shards LoRA-wrapped
linears, ``validate`` checks dimensions before sharding."""
