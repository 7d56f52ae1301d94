"""Parquet inputs of ``shard`` (FineWeb / Dolma dumps): one document per row, in a text column.

Owns: reading a file's text column for the document table (row byte lengths) and a document's
text by row, in bounded record batches (rows per batch from the row group's mean row size, so a
batch holds about BATCH_BYTES of text, or one row when rows are larger), one batch in memory at a
time; a dictionary-encoded string column (pandas' categoricals) stays encoded (rows are looked
up in its dictionary).
pyarrow is optional (extra ``parquet``).

Must never: load a whole file's or row group's text at once, accept a null / non-string text
silently, or let an exhausted memory surface as a traceback (a DataError naming the file and row
group instead).
"""
from __future__ import annotations

import numpy as np

from .format import DataError

INSTALL = "pip install 'hpctrain[parquet]'"
BATCH_BYTES = 8 << 20  # text per record batch read (a larger row is a batch of its own)
MAX_BATCH_ROWS = 1024


class InvalidText(DataError):
    """A row whose text is not valid UTF-8 (`validate` and `shard --filter` count it invalid)."""


def _pyarrow(path: str):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(path, f"reading Parquet needs pyarrow, which is not installed: "
                              f"{INSTALL}") from None
    return pa, pq


def _is_text(pa, kind) -> bool:
    """string / large_string / string_view, or a dictionary of them."""
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return pa.types.is_string(kind) or pa.types.is_large_string(kind) or \
        (hasattr(pa.types, "is_string_view") and pa.types.is_string_view(kind))


def _open(path: str, column: str):
    pa, pq = _pyarrow(path)
    try:
        pf = pq.ParquetFile(path, pre_buffer=False)
    except MemoryError:
        raise DataError(path, "out of memory reading the Parquet footer") from None
    except Exception as e:  # noqa: BLE001 - pyarrow raises its own types for a bad file
        raise DataError(path, f"not a readable Parquet file ({str(e).splitlines()[0][:200]})") from None
    names = pf.schema_arrow.names
    if column not in names:
        raise DataError(path, f"has no column {column!r} (columns: {', '.join(names[:12])}); "
                              f"choose one with --text-column")
    kind = pf.schema_arrow.field(column).type
    if not _is_text(pa, kind):
        raise DataError(path, f"column {column!r} is {kind}, not text")
    return pf


def _rows_per_batch(pf, group: int, column: str) -> int:
    """About BATCH_BYTES of the column's text per batch, by the row group's mean row size."""
    meta = pf.metadata.row_group(group)
    leaf = next((i for i in range(meta.num_columns)
                 if meta.column(i).path_in_schema == column), None)
    text_bytes = meta.column(leaf).total_uncompressed_size if leaf is not None else 0
    if text_bytes <= 0 or meta.num_rows <= 0:
        return 64
    return int(max(1, min(MAX_BATCH_ROWS, BATCH_BYTES * meta.num_rows // text_bytes)))


def _batches(pf, path: str, column: str, first_group: int = 0):
    """(row group, the text column of the next record batch: string/large_string or a dictionary
    of them) from ``first_group`` on. Memory running out while reading is a DataError naming the row group."""
    for group in range(first_group, pf.num_row_groups):
        reader = pf.iter_batches(batch_size=_rows_per_batch(pf, group, column), row_groups=[group],
                                 columns=[column], use_threads=False)
        left = pf.metadata.row_group(group).num_rows
        while left > 0:
            held = [_next_text_batch(reader, pf, path, group)]
            left -= len(held[0])
            if left <= 0 or not len(held[0]):
                # the reader keeps its page buffers (~2.5 x a huge row's text) until it is gone
                left, reader = 0, None
                if held[0].nbytes > BATCH_BYTES:
                    _release_freed_memory()
            yield group, held.pop()  # this frame keeps no reference while the caller holds it


def _next_text_batch(reader, pf, path: str, group: int):
    import pyarrow as pa

    try:
        batch = next(reader, None)
        arr = batch.column(0) if batch is not None else pa.array([], pa.string())
        del batch
        values = arr.type.value_type if pa.types.is_dictionary(arr.type) else arr.type
        if not (pa.types.is_string(values) or pa.types.is_large_string(values)):  # string_view
            arr = (arr.dictionary_decode() if values is not arr.type else arr).cast(pa.large_string())
        return arr  # a dictionary (pandas' categoricals) stays one: its rows are looked up
    except MemoryError:
        raise _out_of_memory(pf, path, group) from None
    except (OSError, ValueError, pa.ArrowException) as e:
        raise DataError(f"{path} row group {group}", f"cannot be read "
                        f"({str(e).splitlines()[0][:200]})") from None


def _release_freed_memory() -> None:
    """Hand Arrow's freed memory back to the system: its allocator keeps it, so a huge row's
    buffers would stay resident under the text and tokens that follow."""
    import pyarrow as pa

    pa.default_memory_pool().release_unused()


def _out_of_memory(pf, path: str, group: int) -> DataError:
    meta = pf.metadata.row_group(group)
    return DataError(f"{path} row group {group}",
                     f"out of memory reading it ({meta.num_rows} rows, "
                     f"{meta.total_byte_size / 2 ** 20:,.0f} MiB uncompressed): give the process "
                     f"more memory (docs/data.md: memory bound) or rewrite the file with smaller "
                     f"rows / row groups")


def row_lengths(path: str, column: str) -> np.ndarray:
    """UTF-8 byte length of each row's text (int64), batch by batch."""
    pf = _open(path, column)
    import pyarrow as pa
    import pyarrow.compute as pc

    parts, row = [], 0
    for _, arr in _batches(pf, path, column):
        if pa.types.is_dictionary(arr.type):  # each row's length is its dictionary value's
            lengths = pc.take(pc.binary_length(arr.dictionary), arr.indices)
        else:
            lengths = pc.binary_length(arr)
        if lengths.null_count:
            first = int(np.flatnonzero(lengths.is_null().to_numpy(zero_copy_only=False))[0])
            raise DataError(path, f"row {row + first}: column {column!r} is null")
        parts.append(lengths.to_numpy(zero_copy_only=False).astype(np.int64))
        row += len(arr)
        big = arr.nbytes > BATCH_BYTES
        del arr, lengths
        if big:
            _release_freed_memory()
    _release_freed_memory()
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


class _TextColumn:
    """One batch's texts by index, decoded straight from the Arrow data buffer (no bytes copy in
    between: a 300 MB row costs its str only); a dictionary's rows are its values'."""

    def __init__(self, arr):
        import pyarrow as pa

        self.indices = None
        if pa.types.is_dictionary(arr.type):
            self.indices = arr.indices.to_numpy(zero_copy_only=False)
            arr = arr.dictionary
        _, offsets, data = arr.buffers()
        width = np.int64 if pa.types.is_large_string(arr.type) else np.int32
        self.offsets = np.frombuffer(offsets, dtype=width)[arr.offset: arr.offset + len(arr) + 1]
        self.data = memoryview(data) if data is not None else memoryview(b"")
        self.arr = arr  # keeps the buffers alive

    def __getitem__(self, i: int) -> str:
        if self.indices is not None:
            i = int(self.indices[i])
        lo, hi = int(self.offsets[i]), int(self.offsets[i + 1])
        return str(self.data[lo:hi], "utf-8") if hi > lo else ""


class RowReader:
    """Texts of one Parquet file by row number (rows asked for in increasing order read the file
    once, forward), holding one record batch of its text column at a time and none after a
    batch's last row was taken."""

    def __init__(self, path: str, column: str):
        self.path, self.column = path, column
        self.pf = _open(path, column)
        sizes = [self.pf.metadata.row_group(g).num_rows for g in range(self.pf.num_row_groups)]
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.batches, self.arr, self.first, self.end, self.group = None, None, 0, 0, 0

    def text(self, row: int) -> str:
        if self.arr is None or not self.first <= row < self.end:
            self._seek(row)
        try:
            text = self.arr[row - self.first]
        except UnicodeDecodeError as e:  # Arrow does not check it when reading Parquet
            raise InvalidText(f"{self.path} row {row}", f"column {self.column!r} is not valid "
                                                        f"UTF-8 (byte {e.start})") from None
        except MemoryError:
            raise _out_of_memory(self.pf, self.path, self.group) from None
        if row == self.end - 1:  # a huge row's Arrow buffers go before it is tokenized
            self.arr = None
            if len(text) > BATCH_BYTES:
                _release_freed_memory()
        return text

    def _seek(self, row: int) -> None:
        if self.batches is None or row < self.end:  # not ahead of the batch: from its row group
            group = int(np.searchsorted(self.starts, row, side="right") - 1)
            self.batches = _batches(self.pf, self.path, self.column, group)
            self.end = int(self.starts[group])
        self.arr = None
        while row >= self.end:
            got = next(self.batches, None)
            if got is None:
                raise DataError(self.path, f"has no row {row} (the file changed while sharding?)")
            self.group, arr = got
            self.first, self.end = self.end, self.end + len(arr)
            self.arr = _TextColumn(arr) if row < self.end else None
            del arr
