"""Parameter-server bridge: sparse embedding tables on server ranks, pulled and pushed by workers over RPC.

- :mod:`~parallelkit.ps.table`: a table shard (lazy rows, deterministic init, per-row optimizers, snapshots);
- :mod:`~parallelkit.ps.server`: the server process's tables and request handlers (sync/async/geo);
- :mod:`~parallelkit.ps.client`: batched, deduplicated, per-server-parallel pull/push from a worker;
- :mod:`~parallelkit.ps.embedding`: :class:`ShardedEmbedding`, used like ``nn.EmbeddingBag``;
- :mod:`~parallelkit.ps.roles`: server/worker roles, :class:`PSDims`, the RPC agent.

See docs/parameter_server.md.
"""

from parallelkit.ps.client import PSClient
from parallelkit.ps.embedding import ShardedEmbedding, apply_parameter_server
from parallelkit.ps.roles import PSDims, init_rpc, rpc_name
from parallelkit.ps.table import TableShard, TableSpec, init_rows

__all__ = ["PSClient", "PSDims", "ShardedEmbedding", "TableShard", "TableSpec", "apply_parameter_server", "init_rows", "init_rpc", "rpc_name"]
