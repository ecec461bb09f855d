#!/usr/bin/env python3
"""Render a kustomization without the kustomize binary: exactly the subset deploy/k8s uses.

    python deploy/render.py deploy/k8s/overlays/dev > dev.yaml     # then: kubectl apply -f dev.yaml

`kubectl apply -k` / `kustomize build` remain the real thing; this renderer exists so the manifests
can be rendered and checked where neither is installed (tests/deploy compares the two when
`kubectl` or `kustomize` is on PATH). Supported kustomization fields:

- `resources`: YAML files (several documents each) and directories holding a kustomization;
- `patches`: strategic merge patches, from `path` or inline `patch`, matched by kind and name
  (no `target`, no JSON 6902). Maps merge; `null` deletes a key; the lists of the Kubernetes API
  that merge by key (containers, env, volumes, volumeMounts, ports, ...) merge by that key and
  accept `$patch: delete` items; a few atomic lists (command, args, projected sources, ...) are
  replaced; any other list in a patch is refused rather than guessed at;
- `namespace`: set on every namespaced object;
- `images`: `name` with `newName`, `newTag` and/or `digest`.

Any other field (generators, name prefixes, labels, replacements, components, ...) is refused with
RenderError, so a kustomization that outgrows this file fails loudly instead of rendering wrongly.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_FIELDS = frozenset({"apiVersion", "kind", "resources", "patches", "namespace", "images"})

#: List fields of the Kubernetes API that strategic merge patches merge item by item, and the key
#: that identifies an item. `ports` depends on where it is: see `_merge_key`.
MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "imagePullSecrets": "name",
}
#: List fields that a patch replaces as a whole (no merge strategy in the API).
ATOMIC_LISTS = frozenset(
    {"command", "args", "sources", "items", "values", "add", "drop", "policyTypes", "accessModes"}
)
#: Kinds without a namespace (among those this repository uses, plus the usual ones).
CLUSTER_SCOPED = frozenset(
    {
        "Namespace",
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "PersistentVolume",
        "StorageClass",
        "PriorityClass",
        "ClusterIssuer",
        "MutatingWebhookConfiguration",
        "ValidatingWebhookConfiguration",
    }
)
#: Output order, after kustomize's "legacy" order: what others depend on comes first.
KIND_ORDER = (
    "Namespace",
    "ResourceQuota",
    "StorageClass",
    "CustomResourceDefinition",
    "ServiceAccount",
    "Role",
    "ClusterRole",
    "RoleBinding",
    "ClusterRoleBinding",
    "ConfigMap",
    "Secret",
    "Endpoints",
    "Service",
    "LimitRange",
    "PriorityClass",
    "PersistentVolume",
    "PersistentVolumeClaim",
    "Deployment",
    "StatefulSet",
    "CronJob",
    "PodDisruptionBudget",
)


class RenderError(Exception):
    """A kustomization this renderer cannot render exactly as kustomize would."""


def render(directory: str | Path) -> list[Obj]:
    """The objects the kustomization in `directory` produces, in kustomize's legacy order."""
    objects = _build(Path(directory).resolve(), stack=())
    return sorted(objects, key=_sort_key)


def dump(objects: Iterable[Obj]) -> str:
    """Objects as one multi-document YAML stream (multi-line strings as literal blocks)."""
    return yaml.dump_all(list(objects), Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def object_id(obj: Obj) -> tuple[str, str, str, str]:
    """(apiVersion, kind, namespace, name): what must be unique in one rendering."""
    meta = obj.get("metadata") or {}
    return (obj.get("apiVersion", ""), obj.get("kind", ""), meta.get("namespace", ""), meta.get("name", ""))


def strategic_merge(base: Any, patch: Any, path: tuple[str, ...] = ()) -> Any:
    """`patch` applied to `base` with the strategic-merge rules described in the module docstring."""
    if isinstance(patch, dict) and isinstance(base, dict):
        if "$patch" in patch:
            raise RenderError(f"{_where(path)}: $patch: {patch['$patch']} on a map is not supported")
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, (*path, key))
            else:
                out[key] = _strip_directives(value, (*path, key))
        return out
    if isinstance(patch, list) and isinstance(base, list):
        return _merge_list(base, patch, path)
    return _strip_directives(patch, path)


def _build(directory: Path, stack: tuple[Path, ...]) -> list[Obj]:
    if directory in stack:
        raise RenderError(f"{directory}: kustomization includes itself")
    kustomization = _read_kustomization(directory)
    objects: list[Obj] = []
    for entry in kustomization.get("resources") or []:
        target = (directory / entry).resolve()
        if target.is_dir():
            objects += _build(target, (*stack, directory))
        elif target.is_file():
            objects += _load_documents(target)
        else:
            raise RenderError(f"{directory}: resource {entry!r} does not exist")
    _check_unique(objects, directory)
    for number, entry in enumerate(kustomization.get("patches") or []):
        for patch in _patch_documents(directory, entry, number):
            _apply_patch(objects, patch, directory)
    namespace = kustomization.get("namespace")
    if namespace is not None:
        for obj in objects:
            if obj.get("kind") not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = namespace
    for image in kustomization.get("images") or []:
        _set_image(objects, image, directory)
    _check_unique(objects, directory)
    return objects


def _read_kustomization(directory: Path) -> Obj:
    found = [directory / name for name in KUSTOMIZATION_FILES if (directory / name).is_file()]
    if len(found) != 1:
        raise RenderError(f"{directory}: expected exactly one of {', '.join(KUSTOMIZATION_FILES)}")
    data = yaml.safe_load(found[0].read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        raise RenderError(f"{found[0]}: not a mapping")
    unsupported = sorted(set(data) - SUPPORTED_FIELDS)
    if unsupported:
        raise RenderError(f"{found[0]}: fields not supported by deploy/render.py: {', '.join(unsupported)}")
    return data


def _load_documents(path: Path) -> list[Obj]:
    out: list[Obj] = []
    for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
        if doc is None:
            continue
        if not isinstance(doc, dict) or not {"apiVersion", "kind", "metadata"} <= set(doc):
            raise RenderError(f"{path}: every document needs apiVersion, kind and metadata")
        out.append(doc)
    return out


def _patch_documents(directory: Path, entry: Any, number: int) -> list[Obj]:
    if not isinstance(entry, dict) or set(entry) - {"path", "patch"} or len(entry) != 1:
        raise RenderError(
            f"{directory}: patches[{number}] must have exactly one of `path` or `patch` (no target, options)"
        )
    text = (directory / entry["path"]).read_text(encoding="utf-8") if "path" in entry else entry["patch"]
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    if len(docs) != 1 or not isinstance(docs[0], dict):
        raise RenderError(f"{directory}: patches[{number}] must be one strategic merge patch document")
    return docs


def _apply_patch(objects: list[Obj], patch: Obj, directory: Path) -> None:
    kind = patch.get("kind")
    meta = patch.get("metadata") or {}
    name = meta.get("name")
    group = _group(patch.get("apiVersion", ""))
    matches = [
        i
        for i, obj in enumerate(objects)
        if obj.get("kind") == kind
        and obj["metadata"].get("name") == name
        and _group(obj.get("apiVersion", "")) == group
        and ("namespace" not in meta or obj["metadata"].get("namespace") == meta["namespace"])
    ]
    if len(matches) != 1:
        raise RenderError(f"{directory}: patch for {kind}/{name} matches {len(matches)} objects, not 1")
    i = matches[0]
    body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind")}
    objects[i] = strategic_merge(objects[i], body, (str(kind),))


def _merge_list(base: list[Any], patch: list[Any], path: tuple[str, ...]) -> list[Any]:
    field = path[-1] if path else ""
    key = _merge_key(path)
    if key is None:
        if field in ATOMIC_LISTS:
            return list(_strip_directives(patch, path))
        raise RenderError(f"{_where(path)}: deploy/render.py does not know how kustomize merges this list")
    # Like kustomize (kyaml): the patch's items first, in the patch's order (merged with the base
    # item of the same key, if any), then the base items the patch does not name, in their order.
    # Mind it when an env value refers to another variable with $(NAME): that one must come first.
    out: list[Any] = []
    named: set[Any] = set()
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise RenderError(f"{_where(path)}: every item of a patched {field} needs {key!r}")
        named.add(item[key])
        old = next((b for b in base if isinstance(b, dict) and b.get(key) == item[key]), None)
        directive = item.get("$patch")
        if directive == "delete":
            continue
        if directive is not None:
            raise RenderError(f"{_where(path)}: $patch: {directive} is not supported")
        out.append(_strip_directives(item, path) if old is None else strategic_merge(old, item, path))
    out += [copy.deepcopy(b) for b in base if not (isinstance(b, dict) and b.get(key) in named)]
    return out


def _merge_key(path: tuple[str, ...]) -> str | None:
    field = path[-1] if path else ""
    if field == "ports":
        # Container ports merge by containerPort, a Service's ports by port.
        return "containerPort" if any(p in ("containers", "initContainers") for p in path) else "port"
    return MERGE_KEYS.get(field)


def _strip_directives(value: Any, path: tuple[str, ...]) -> Any:
    if isinstance(value, dict):
        if "$patch" in value:
            raise RenderError(f"{_where(path)}: $patch where nothing is merged")
        return {k: _strip_directives(v, (*path, k)) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_strip_directives(v, path) for v in value]
    return copy.deepcopy(value)


def _set_image(objects: list[Obj], image: Any, directory: Path) -> None:
    if (
        not isinstance(image, dict)
        or "name" not in image
        or set(image) - {"name", "newName", "newTag", "digest"}
    ):
        raise RenderError(f"{directory}: images entries need `name` and only newName/newTag/digest")
    for obj in objects:
        for container in _containers(obj):
            reference = container.get("image")
            if not isinstance(reference, str):
                continue
            name, tag, digest = _split_image(reference)
            if name != image["name"]:
                continue
            name = image.get("newName", name)
            if "digest" in image:
                container["image"] = f"{name}@{image['digest']}"
            elif "newTag" in image:
                container["image"] = f"{name}:{image['newTag']}"
            else:
                container["image"] = name + (f"@{digest}" if digest else f":{tag}" if tag else "")


def _containers(node: Any) -> Iterable[Obj]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from (c for c in value if isinstance(c, dict))
            else:
                yield from _containers(value)
    elif isinstance(node, list):
        for item in node:
            yield from _containers(item)


def _split_image(reference: str) -> tuple[str, str, str]:
    """(name, tag, digest) of an image reference; a port in the registry host is not a tag."""
    name, _, digest = reference.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        return name[:colon], name[colon + 1 :], digest
    return name, "", digest


def _group(api_version: str) -> str:
    return api_version.rpartition("/")[0]


def _check_unique(objects: list[Obj], directory: Path) -> None:
    seen: set[tuple[str, str, str, str]] = set()
    for obj in objects:
        ident = object_id(obj)
        if ident in seen:
            raise RenderError(f"{directory}: {ident[1]}/{ident[3]} appears twice")
        seen.add(ident)


def _sort_key(obj: Obj) -> tuple[int, str, str, str]:
    kind = obj.get("kind", "")
    rank = KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER)
    api, _, namespace, name = object_id(obj)
    return (rank, f"{api}/{kind}" if rank == len(KIND_ORDER) else "", namespace, name)


def _where(path: tuple[str, ...]) -> str:
    return ".".join(path) or "<root>"


class _Dumper(yaml.SafeDumper):
    """SafeDumper that writes multi-line strings (scripts, embedded config files) as blocks."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    if "\n" in value:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")
    return dumper.represent_scalar("tag:yaml.org,2002:str", value)


_Dumper.add_representer(str, _represent_str)


def main(argv: list[str] | None = None) -> int:
    """Command line: render one kustomization directory to standard output."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    parser.add_argument("directory", help="a directory holding a kustomization.yaml")
    args = parser.parse_args(argv)
    try:
        sys.stdout.write(dump(render(args.directory)))
    except (RenderError, OSError, yaml.YAMLError) as exc:
        print(f"render.py: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
