"""Dataset tools over shard folders: inspect, stats, validate, convert, merge / dedupe / split (see docs/architecture.md).

Everything streams record batches (``pyarrow.parquet.ParquetFile.iter_batches``), so
memory does not grow with the dataset; outputs are always new folders, written
atomically, and inputs are never modified.
"""

from distill.data.dataset import Dataset, split_folders
from distill.data.stats import DatasetStats, TeacherStats, compute_stats, teacher_position_stats
from distill.data.transform import TransformSummary, dedupe, eval_side, merge, split, user_text_key
from distill.data.validate import Problem, ValidationReport, validate_dataset

__all__ = [
    "Dataset", "DatasetStats", "Problem", "TeacherStats", "TransformSummary", "ValidationReport", "compute_stats",
    "dedupe", "eval_side", "merge", "split", "split_folders", "teacher_position_stats",
    "user_text_key", "validate_dataset",
]
