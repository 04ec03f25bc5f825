"""Offline datasets: LeRobot v3.0 (read/write) and v2.1 (read), robomimic/LIBERO HDF5 (read), and the
chunk sampler that turns any of them into training batches for the model core. See docs/DATASETS.md."""

from vlamux.data.episodes import Episode, EpisodeDataset, EpisodeInfo
from vlamux.data.errors import DatasetError, DatasetFormatError, MissingKeyError
from vlamux.data.hdf5 import RobomimicDataset
from vlamux.data.lerobot import LeRobotDataset
from vlamux.data.lerobot_format import CODEBASE_VERSION
from vlamux.data.stats import aggregate_stats, feature_stats, image_stats
from vlamux.data.lerobot_writer import LeRobotWriter
from vlamux.data.sampler import Batch, ChunkSampler

__all__ = [
    "Batch", "CODEBASE_VERSION", "ChunkSampler", "DatasetError", "DatasetFormatError", "Episode", "EpisodeDataset",
    "EpisodeInfo", "LeRobotDataset", "LeRobotWriter", "MissingKeyError", "RobomimicDataset", "aggregate_stats",
    "feature_stats", "image_stats",
]
