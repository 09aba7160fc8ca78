"""Regenerate the structural CRD schemas under tests/support/schemas/ from ../shared/kuberay-crds/.

Keeps only each CRD's v1 openAPIV3Schema, without descriptions (a tenth of the size),
so tests validate manifests against exactly the schema the API server uses.
Run: python tests/support/schemas/make_structural.py [path/to/kuberay-crds]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).parent


def strip(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node


def main(source: Path) -> None:
    for version_dir, label in ((source / "v1.5.0", "v1.5.0"), (source, "v1.7.0")):
        for kind in ("rayclusters", "rayservices"):
            crd = yaml.safe_load((version_dir / f"ray.io_{kind}.yaml").read_text())
            (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
            out = HERE / label / f"{kind}.json"
            out.parent.mkdir(exist_ok=True)
            out.write_text(json.dumps(strip(v1["schema"]["openAPIV3Schema"]), sort_keys=True) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE.parents[3] / "shared" / "kuberay-crds")
