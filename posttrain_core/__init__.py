"""posttrain core library: artifact store, Arrow data, models, algorithms and training loops.

Usable without Prefect; `tasks/` and `flows/` wrap these functions into a pipeline.
"""

__version__ = "0.1.0"
