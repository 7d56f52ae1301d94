"""The dataset at ``data.path``, opened once per rank: its manifest.json read one time and handed
to everything that needs it (the node cache, the verifier, the split readers, the tokenizer).

Owns: reading and validating ``data.path``'s manifest once (``Dataset.open``), its kind (a plain
sharded dataset or a blend), the flattened shard list the trainer, verify and the node cache index
(``data_tools.blend.data_manifest``), the tokenizer facts, and opening a split reader from that one
reading. Must never: define the on-disk format (data_tools.format does) or read tokens itself.
"""
from __future__ import annotations

from dataclasses import dataclass

from data_tools.blend import data_manifest
from data_tools.format import KIND_BLEND, KIND_SHARDS, load_manifest_json
from data_tools.tokenizers import tokenizer_file_of
from data_tools.verify import verify_dataset

from .blend import open_split


@dataclass(frozen=True)
class Dataset:
    path: str       # data.path as configured
    loaded: dict    # its manifest.json as read (format_version and kind checked)
    manifest: dict  # data_manifest: as is, or a blend's components' shards flattened
    manifest_bytes: bytes  # manifest.json's bytes (the node cache's key hashes them)

    @classmethod
    def open(cls, path: str) -> "Dataset":
        """Read ``path``'s manifest.json (the only time this rank reads it); DataError naming it."""
        loaded, raw = load_manifest_json(path)
        return cls(path, loaded, data_manifest(path, loaded), raw)

    @property
    def kind(self) -> str:
        """KIND_SHARDS (a plain sharded dataset) or KIND_BLEND."""
        return self.loaded.get("kind", KIND_SHARDS)

    @property
    def is_blend(self) -> bool:
        return self.kind == KIND_BLEND

    def tokenizer_info(self) -> dict:
        """The manifest's tokenizer facts plus where its tokenizer.json is (for `sample`); a chat
        dataset's also "format": "chat" (its special tokens were encoded as such: export)."""
        info = dict(self.manifest["tokenizer"])
        info.update(tokenizer_file_of(self.path, self.manifest))
        if self.manifest.get("format") == "chat":
            info["format"] = "chat"
        return info

    def open_split(self, split: str, block_size: int, optional: bool = False, **kw):
        """A TokenShards or BlendShards reader of ``split`` (manifest not read again)."""
        return open_split(self.path, split, block_size, optional=optional, loaded=self.loaded, **kw)

    def verify(self, shard_indices, checksums: bool) -> list[str]:
        """data_tools' verify_dataset on ``shard_indices`` of the flattened shard list."""
        return verify_dataset(self.path, shard_indices=shard_indices, checksums=checksums,
                              loaded=self.loaded)
