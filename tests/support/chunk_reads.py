"""Test helper: records what a restore asks of the chunk files (regions, files read)."""

from ucp_jax.store import _direct


class ChunkReads:
  """Patches `_direct` to record, by key, every region asked for and every chunk file read.

  `files` holds the chunk paths as the user named the checkpoint, one entry per read.
  """

  def __init__(self, monkeypatch):
    self.regions: dict[str, list] = {}
    self.files: list[str] = []
    tasks, read_into, mapped = _direct.chunk_reads, _direct.read_chunk_into, _direct.mapped_chunk

    def chunk_reads(files, regions):
      self.regions.setdefault(files.key, []).extend(regions)
      return tasks(files, regions)

    def counted(files, index, out):  # a chunk read straight into one slice
      self.files.append(files.chunk(index)[1])
      return read_into(files, index, out)

    def counted_mapped(files, index):  # a chunk mapped and copied into several
      self.files.append(files.chunk(index)[1])
      return mapped(files, index)

    monkeypatch.setattr(_direct, "chunk_reads", chunk_reads)
    monkeypatch.setattr(_direct, "read_chunk_into", counted)
    monkeypatch.setattr(_direct, "mapped_chunk", counted_mapped)
