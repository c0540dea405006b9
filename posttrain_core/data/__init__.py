"""Data layer: Arrow schemas, validated Parquet datasets, importers, chat tokenization and synthetic tasks.

Imports only pyarrow and the standard library (`datasets` is imported inside the HF importer when used).
"""

from posttrain_core.data.importers import import_file, import_hf
from posttrain_core.data.io import parquet_files, read_dataset, write_dataset
from posttrain_core.data.schemas import MESSAGE, MESSAGES, ROLES, SCHEMAS, SchemaError, validate_table

__all__ = [
    "MESSAGE",
    "MESSAGES",
    "ROLES",
    "SCHEMAS",
    "SchemaError",
    "import_file",
    "import_hf",
    "parquet_files",
    "read_dataset",
    "validate_table",
    "write_dataset",
]
