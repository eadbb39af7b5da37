"""Conversions between numpy arrays and the wire's messages, shared by every service."""

from __future__ import annotations

import numpy as np

from chorus.v1 import common_pb2


def rows_matrix(rows: np.ndarray) -> common_pb2.IntMatrix:
    arr = np.ascontiguousarray(rows, dtype="<i4")
    return common_pb2.IntMatrix(rows=arr.shape[0], cols=arr.shape[1], data=arr.tobytes())


def matrix_array(m: common_pb2.IntMatrix) -> np.ndarray:
    """rows_matrix's inverse (a read-only view of the message's bytes)."""
    if m.rows < 0 or m.cols < 0 or len(m.data) != 4 * m.rows * m.cols:
        raise ValueError(f"{len(m.data)} bytes do not hold a {m.rows}x{m.cols} int32 matrix")
    return np.frombuffer(m.data, dtype="<i4").reshape(m.rows, m.cols)
