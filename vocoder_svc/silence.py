"""Silence detection on 16-bit mono samples, with pydub's results to the sample.

OmniVoice's reference trims silence with pydub, which walks the clip in Python one slice at a time
(7 ms for a 6 s clip on a slow core, on the codec's decode thread). Here every window's sum of
squares comes from one pass over the samples. What makes the results equal pydub's, not just close:

  * positions are milliseconds, turned into samples as pydub does: int(ms * (rate / 1000.0)), and
    the length in ms rounded from the sample count;
  * a slice that ends past the last sample (the rounding above) is padded with zeros, and they count
    in its RMS, unless it starts past the end (then it is empty);
  * RMS is audioop's: sqrt(sum of squares / samples) in float64, truncated to an integer. The sums
    are of integers below 2^53, so their order does not matter;
  * a slice is silent when that RMS is <= the threshold as an amplitude (detect_silence), or when
    its dBFS, 20 * log(rms / 32768, 10), is below it (detect_leading_silence).
"""

from __future__ import annotations

import math

import numpy as np

FULL_SCALE = 32768.0  # pydub's max_possible_amplitude for 16-bit samples


class Pcm:
    """16-bit mono samples at `rate`, addressed in milliseconds as a pydub AudioSegment is."""

    def __init__(self, samples: np.ndarray, rate: int):
        self.samples = np.asarray(samples, dtype=np.int16)
        self.rate = rate

    def __len__(self) -> int:
        return round(1000 * (float(len(self.samples)) / self.rate))

    def _spans(self, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """pydub's slices [start, end) ms, all at once: (first sample, samples taken from the data,
        zeros appended after them). Ends past the length in ms are clamped to it; a slice that then
        reaches past the last sample (the length's rounding) is padded with zeros, unless it takes
        nothing from the data."""
        n, seg_len, per_ms = len(self.samples), len(self), self.rate / 1000.0
        a = (np.minimum(starts, seg_len) * per_ms).astype(np.int64)  # exact: an integer times a float, truncated
        b = (np.minimum(ends, seg_len) * per_ms).astype(np.int64)
        have = np.clip(np.minimum(b, n) - a, 0, None)
        zeros = np.where(have > 0, (b - a) - have, 0)
        if (zeros > self.rate * 2 / 1000.0).any():
            raise ValueError("a slice reaches more than 2 ms past the last sample")
        return np.minimum(a, n), have, zeros

    def __getitem__(self, ms: slice) -> "Pcm":
        start = 0 if ms.start is None else ms.start
        end = len(self) if ms.stop is None else ms.stop
        if start < 0 or end < 0:
            raise ValueError(f"slice [{start}, {end}) ms: positions count from the start here")
        (a,), (have,), (zeros,) = self._spans(np.array([start]), np.array([end]))
        data = self.samples[a:a + have]
        return Pcm(np.concatenate([data, np.zeros(zeros, np.int16)]) if zeros else data, self.rate)

    def reverse(self) -> "Pcm":
        return Pcm(self.samples[::-1], self.rate)

    def rms(self, starts: np.ndarray, length: int) -> np.ndarray:
        """audioop.rms of each slice [start, start + length) ms (starts >= 0), as integers, the sums
        of squares taken between the slices' edges only."""
        n = len(self.samples)
        a, have, zeros = self._spans(starts, starts + length)
        edges = np.unique(np.concatenate([[0, n], a, a + have]))
        blocks = np.add.reduceat(self.samples.astype(np.int64) ** 2, edges[:-1]) if n else np.zeros(0, np.int64)
        prefix = np.concatenate([[0], np.cumsum(blocks)])  # sum of squares before each edge
        sums = (prefix[np.searchsorted(edges, a + have)] - prefix[np.searchsorted(edges, a)]).astype(np.float64)
        count = have + zeros
        out = np.zeros(len(starts), np.int64)
        some = count > 0
        out[some] = np.sqrt(sums[some] / count[some]).astype(np.int64)
        return out


def silence_threshold(dbfs: float) -> float:
    """pydub's db_to_float(dbfs) * max_possible_amplitude."""
    return 10 ** (float(dbfs) / 20) * FULL_SCALE


def detect_silence(pcm: Pcm, min_silence_len: int, silence_thresh: float, seek_step: int) -> list[list[int]]:
    """[start, end] ms of every run of at least min_silence_len ms whose windows are silent."""
    seg_len = len(pcm)
    if seg_len < min_silence_len:
        return []
    last = seg_len - min_silence_len
    starts = list(range(0, last + 1, seek_step)) + ([last] if last % seek_step else [])
    rms = pcm.rms(np.asarray(starts, dtype=np.int64), min_silence_len)
    silent = [s for s, r in zip(starts, rms.tolist()) if r <= silence_threshold(silence_thresh)]
    if not silent:
        return []
    ranges, prev, begin = [], silent[0], silent[0]
    for s in silent[1:]:
        if s != prev + seek_step and s > prev + min_silence_len:
            ranges.append([begin, prev + min_silence_len])
            begin = s
        prev = s
    ranges.append([begin, prev + min_silence_len])
    return ranges


def detect_nonsilent(pcm: Pcm, min_silence_len: int, silence_thresh: float, seek_step: int) -> list[list[int]]:
    """[start, end] ms of what lies between detect_silence's runs."""
    silent = detect_silence(pcm, min_silence_len, silence_thresh, seek_step)
    seg_len = len(pcm)
    if not silent:
        return [[0, seg_len]]
    if silent[0][0] == 0 and silent[0][1] == seg_len:
        return []
    out, prev_end = [], 0
    for start, end in silent:
        out.append([prev_end, start])
        prev_end = end
    if silent[-1][1] != seg_len:
        out.append([prev_end, seg_len])
    if out[0] == [0, 0]:
        out.pop(0)
    return out


def split_on_silence(pcm: Pcm, min_silence_len: int, silence_thresh: float, keep_silence: int,
                     seek_step: int) -> list[Pcm]:
    """The sounds between long silences, each keeping up to keep_silence ms of silence either side
    (shared halfway where two would overlap)."""
    ranges = [[start - keep_silence, end + keep_silence]
              for start, end in detect_nonsilent(pcm, min_silence_len, silence_thresh, seek_step)]
    for left, right in zip(ranges, ranges[1:]):
        if right[0] < left[1]:
            left[1] = (left[1] + right[0]) // 2
            right[0] = left[1]
    return [pcm[max(start, 0):min(end, len(pcm))] for start, end in ranges]


def detect_leading_silence(pcm: Pcm, silence_threshold_dbfs: float, chunk_size: int = 10) -> int:
    """ms of silence at the start: whole chunks whose dBFS is below the threshold."""
    seg_len = len(pcm)
    starts = np.arange(0, seg_len + chunk_size, chunk_size, dtype=np.int64)
    trim = 0
    for rms in pcm.rms(starts, chunk_size).tolist():
        dbfs = -math.inf if rms == 0 else 20 * math.log(rms / FULL_SCALE, 10)
        if not (dbfs < silence_threshold_dbfs and trim < seg_len):
            break
        trim += chunk_size
    return min(trim, seg_len)
