"""Write and read datasets: folders of Parquet files, validated against their kind's schema on both sides.

Paths may be local or any pyarrow filesystem URI (s3://bucket/key, ...).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from posttrain_core.data.schemas import validate_table


def _filesystem(path: str | Path) -> tuple[pafs.FileSystem, str]:
    text = str(path)
    if "://" in text:
        return pafs.FileSystem.from_uri(text)
    return pafs.LocalFileSystem(), str(Path(text).absolute())


def write_dataset(table: pa.Table, kind: str, out_dir: str | Path, rows_per_file: int = 100_000) -> dict:
    """Validate `table` as `kind` and write it as `out_dir/part-00000.parquet`, `part-00001.parquet`, ...

    Validation runs first, so nothing is written when the table is invalid.

    Args:
        table: the rows; extra columns are kept.
        kind: a key of `SCHEMAS`.
        out_dir: a folder (created if needed) that holds no parquet files yet.
        rows_per_file: at most this many rows per file.

    Returns:
        {"schema_kind", "num_rows", "files" (names relative to out_dir), "schema" (str of the Arrow schema)}:
        what an artifact manifest records.
    """
    if rows_per_file < 1:
        raise ValueError(f"rows_per_file must be >= 1, got {rows_per_file}")
    table = validate_table(table, kind, source=str(out_dir))
    if table.num_rows == 0:
        raise ValueError(f"{out_dir}: refusing to write an empty '{kind}' dataset")
    fs, root = _filesystem(out_dir)
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.File:
        raise ValueError(f"{out_dir}: is a file, expected a folder")
    if info.type == pafs.FileType.Directory:
        existing = [f.path for f in fs.get_file_info(pafs.FileSelector(root)) if f.path.endswith(".parquet")]
        if existing:
            raise FileExistsError(f"{out_dir}: already holds parquet files ({Path(existing[0]).name}, ...)")
    fs.create_dir(root, recursive=True)
    files = []
    for n, start in enumerate(range(0, table.num_rows, rows_per_file)):
        name = f"part-{n:05d}.parquet"
        pq.write_table(table.slice(start, rows_per_file), f"{root}/{name}", filesystem=fs)
        files.append(name)
    return {"schema_kind": kind, "num_rows": table.num_rows, "files": files, "schema": str(table.schema)}


def parquet_files(path: str | Path) -> list[str]:
    """The parquet files of a dataset: `path` itself if it is a file, else the folder's `*.parquet`, sorted."""
    fs, root = _filesystem(path)
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"{path}: no such file or folder")
    if info.type == pafs.FileType.File:
        return [root]
    files = sorted(
        f.path
        for f in fs.get_file_info(pafs.FileSelector(root))
        if f.type == pafs.FileType.File and f.path.endswith(".parquet") and not Path(f.path).name.startswith((".", "_"))
    )
    if not files:
        raise FileNotFoundError(f"{path}: folder holds no parquet files")
    return files


def read_dataset(path: str | Path, kind: str) -> pa.Table:
    """Read a folder of parquet files (or one file) and validate each file as `kind`; errors name the file.

    Returns:
        One table with `SCHEMAS[kind]`'s columns first, then any extra columns.
    """
    fs, _ = _filesystem(path)
    prefix = str(path).split("://", 1)[0] + "://" if "://" in str(path) else ""
    tables = []
    for file in parquet_files(path):
        try:
            raw = pq.read_table(file, filesystem=fs)
        except (OSError, pa.ArrowInvalid) as err:
            raise ValueError(f"{prefix}{file}: not a readable parquet file ({err})") from None
        tables.append(validate_table(raw, kind, source=f"{prefix}{file}"))
    return tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="permissive")
