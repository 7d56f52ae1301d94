"""Parquet inputs of ``shard`` (FineWeb / Dolma dumps): one document per row, in a text column.

Owns: reading a file's text column for the document table (row byte lengths) and a document's
text by row, one row group in memory at a time.  pyarrow is optional (extra ``parquet``).

Must never: load a whole file's text at once, or accept a null / non-string text silently.
"""
from __future__ import annotations

import numpy as np

from .format import DataError

INSTALL = "pip install 'hpctrain[parquet]'"


def _pyarrow(path: str):
    try:
        import pyarrow.compute as pc
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(path, f"reading Parquet needs pyarrow, which is not installed: "
                              f"{INSTALL}") from None
    return pq, pc


def _open(path: str, column: str):
    pq, pc = _pyarrow(path)
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises its own types for a bad file
        raise DataError(path, f"not a readable Parquet file ({str(e).splitlines()[0][:200]})") from None
    names = pf.schema_arrow.names
    if column not in names:
        raise DataError(path, f"has no column {column!r} (columns: {', '.join(names[:12])}); "
                              f"choose one with --text-column")
    return pf, pc


def row_lengths(path: str, column: str) -> np.ndarray:
    """UTF-8 byte length of each row's text (int64), row group by row group."""
    pf, pc = _open(path, column)
    import pyarrow as pa

    if not pa.types.is_string(pf.schema_arrow.field(column).type) and \
            not pa.types.is_large_string(pf.schema_arrow.field(column).type):
        raise DataError(path, f"column {column!r} is {pf.schema_arrow.field(column).type}, not text")
    parts, row = [], 0
    for g in range(pf.num_row_groups):
        col = pf.read_row_group(g, columns=[column]).column(column)
        if col.null_count:
            first = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise DataError(path, f"row {row + first}: column {column!r} is null")
        parts.append(pc.binary_length(col).to_numpy().astype(np.int64))
        row += len(col)
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


class RowReader:
    """Texts of one Parquet file by row number, holding one row group's column at a time."""

    def __init__(self, path: str, column: str):
        self.path, self.column = path, column
        self.pf, _ = _open(path, column)
        sizes = [self.pf.metadata.row_group(g).num_rows for g in range(self.pf.num_row_groups)]
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.group, self.texts = -1, []

    def text(self, row: int) -> str:
        g = int(np.searchsorted(self.starts, row, side="right") - 1)
        if g != self.group:
            self.texts = self.pf.read_row_group(g, columns=[self.column]).column(self.column).to_pylist()
            self.group = g
        return self.texts[row - int(self.starts[g])]
