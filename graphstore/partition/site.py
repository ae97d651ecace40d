"""A site partition: the one part a site holds, built from its own dataset alone.

A site's dataset (``retexo ingest tables --remote-sources``) holds the site's nodes and every edge
into them; an edge's source may be a node another site holds. Its site partition has the layout of
any partition with one part (``partitions/dataset=<fp>/fp=<pfp>/part=0/{nodes,edges,halo}.parquet``,
``assignment.parquet``, ``stats.parquet``, method ``site``), except that the halo's ``owner`` is
``-1``: which site holds a remote source is found out over the network when the sites' workers
meet (``retexo_core.sites.discover_owners``), never written into the store.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from graphstore.atomic import atomic_artefact
from graphstore.fingerprint import fingerprint
from graphstore.integrity import intact_manifest, verify_files
from graphstore.layout import LINK_PAIRS, PART_PAIRS, UNKNOWN_OWNER, Store
from graphstore.lookup import PARTITION_FORMAT, DatasetRef, PartitionRef
from graphstore.manifests import DatasetManifest, PartitionManifest
from graphstore.parquet_io import COMPRESSION, edges_table, feature_columns, read_table, take_feature_rows

SITE_METHOD = "site"
log = logging.getLogger(__name__)


def site_partition_fp(dataset_fp: str) -> str:
    return fingerprint({"format": PARTITION_FORMAT, "dataset": dataset_fp, "method": SITE_METHOD, "parts": 1})


def build_site_partition(store: Store, dataset: DatasetRef) -> PartitionRef:
    """The site partition of ``dataset`` (built once; the stored one when it is intact)."""
    fp = site_partition_fp(dataset.fp)
    target = store.partition_dir(dataset.fp, fp)
    if intact_manifest(target, PartitionManifest) is not None:
        return PartitionRef.at(target)
    started = time.perf_counter()
    manifest = dataset.manifest
    verify_files(dataset.path, manifest.data_files, DatasetManifest)
    nodes = read_table(dataset.path / "nodes.parquet", columns=["node_id", "label", "split"])
    features = read_table(dataset.path / "features.parquet", columns=feature_columns(manifest.feature_format))
    edges = read_table(dataset.path / "edges.parquet")
    node_id = nodes.column("node_id").to_numpy()
    src, dst = edges.column("src").to_numpy(), edges.column("dst").to_numpy()
    pos = np.searchsorted(node_id, src).clip(0, len(node_id) - 1)
    remote = node_id[pos] != src
    halo = np.unique(src[remote])
    split = nodes.column("split").to_numpy(zero_copy_only=False)
    stats = [{
        "part": 0, "owned_nodes": len(node_id), "local_edges": int(np.count_nonzero(~remote)),
        "cut_edges": int(np.count_nonzero(remote)), "halo_nodes": len(halo),
        "train": int(np.count_nonzero(split == "train")), "val": int(np.count_nonzero(split == "val")),
        "test": int(np.count_nonzero(split == "test")), "balance": 1.0,
    }]
    with atomic_artefact(store, target) as writer:
        folder = writer.path / "part=0"
        folder.mkdir()
        pq.write_table(pa.table({**{c: nodes.column(c) for c in nodes.column_names},
                                 **take_feature_rows(features, np.arange(len(node_id)))}),
                       folder / "nodes.parquet", compression=COMPRESSION)
        pq.write_table(edges_table(src, dst), folder / "edges.parquet", compression=COMPRESSION)
        pq.write_table(pa.table({"node_id": pa.array(halo, pa.int64()),
                                 "owner": pa.array(np.full(len(halo), UNKNOWN_OWNER), pa.int64())}),
                       folder / "halo.parquet", compression=COMPRESSION)
        if manifest.task == "link":  # the sources' sites are found when the sites meet, as the halo's
            pairs = read_table(dataset.path / LINK_PAIRS)
            own = np.isin(pairs.column("src").to_numpy(), node_id)
            pq.write_table(pairs.append_column("src_owner", pa.array(np.where(own, 0, UNKNOWN_OWNER), pa.int64())),
                           folder / PART_PAIRS, compression=COMPRESSION)
        pq.write_table(pa.table({"node_id": node_id, "part": np.zeros(len(node_id), np.int64)}),
                       writer.path / "assignment.parquet", compression=COMPRESSION)
        pq.write_table(pa.Table.from_pylist(stats), writer.path / "stats.parquet", compression=COMPRESSION)
        writer.manifest = PartitionManifest(
            format=PARTITION_FORMAT, fp=fp, dataset=dataset.fp, dataset_name=dataset.name, method=SITE_METHOD,
            parts=1, edge_cut=stats[0]["cut_edges"], halo_total=len(halo), num_nodes=len(node_id),
            num_edges=len(src), num_features=manifest.num_features, feature_format=manifest.feature_format,
            features_nonnegative=manifest.features_nonnegative, num_classes=manifest.num_classes,
            seconds=round(time.perf_counter() - started, 3), stats=stats,
        )
    log.info("site partition %s of %s: %d nodes, %d edges, %d remote sources", fp, dataset.name,
             len(node_id), len(src), len(halo))
    return PartitionRef.at(target, created=True)
