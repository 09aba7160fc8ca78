"""The API semantics of writes and reads, over the object store: what POST, PUT, PATCH, DELETE and
list do to an object (validation, generateName, optimistic concurrency, the status subresource,
finalizers, dry run, paging), and the thread-safe helpers tests use to set state directly."""

from __future__ import annotations

import base64
import copy
import json
import random
import uuid
from typing import Any

from ._defaults import (
    GENERATE_ALPHABET,
    SYSTEM_META,
    CoreDefaults,
    apply_schema,
    check_type_meta,
    dns_subdomain_error,
    fold_string_data,
)
from ._errors import ApiError
from ._patching import PatchDecodeError, PatchError, json_patch, merge_patch
from ._resources import ResourceType, now_rfc3339, resolve_resource, resource_of
from ._selectors import parse_field_selector, parse_label_selector
from ._store import ObjectStore, carry_system_meta

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"


class Registry:
    """Create / update / patch / delete / list as the real API server does them.

    :param store: where objects live.
    :param schemas: ``(group, version, plural) -> openAPIV3Schema`` for CRD defaulting and pruning.
    """

    def __init__(self, store: ObjectStore, schemas: dict) -> None:
        self.store = store
        self._schemas = schemas
        self._core_defaults = CoreDefaults()

    # -- test helpers (thread-safe, through the same commits and events as API writes) ----------

    @property
    def resource_version(self) -> str:
        with self.store.lock:
            return str(self.store.rv)

    def get_object(self, resource: str | ResourceType, namespace: str, name: str) -> dict | None:
        res = resolve_resource(resource)
        with self.store.lock:
            obj = self.store.get(res, namespace, name)
            return copy.deepcopy(obj) if obj is not None else None

    def list_objects(self, resource: str | ResourceType, namespace: str | None = None, *,
                     label_selector: str | dict | None = None, field_selector: str | None = None) -> list[dict]:
        res = resolve_resource(resource)
        if isinstance(label_selector, dict):
            label_selector = ",".join(f"{k}={v}" for k, v in label_selector.items())
        lreqs = parse_label_selector(label_selector)
        freqs = parse_field_selector(field_selector, res.plural, custom=res.custom)
        with self.store.lock:
            return [copy.deepcopy(o) for o in self.store.select(res, namespace, lreqs, freqs)]

    def put_object(self, obj: dict) -> dict:
        res = resource_of(obj)
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        ns = meta.setdefault("namespace", "default")
        name = meta["name"]
        obj.setdefault("apiVersion", res.api_version)
        obj.setdefault("kind", res.kind)
        with self.store.lock:
            old = self.store.get(res, ns, name)
            if old is None:
                for k in ("resourceVersion", "deletionTimestamp"):
                    meta.pop(k, None)
                meta.setdefault("uid", str(uuid.uuid4()))
                meta.setdefault("creationTimestamp", now_rfc3339())
                if res.tracks_generation:
                    meta["generation"] = meta.get("generation") or 1
                return copy.deepcopy(self.store.commit_create(res, obj))
            carry_system_meta(old, obj, keep_deletion=("deletionTimestamp" not in meta))
            return copy.deepcopy(self.store.commit_update(res, old, obj))

    def create_object(self, obj: dict, *, namespace: str | None = None) -> dict:
        ns = namespace or (obj.get("metadata") or {}).get("namespace") or "default"
        created, _ = self.create(resource_of(obj), ns, obj)
        return copy.deepcopy(created)

    def patch_object(self, resource: str | ResourceType, namespace: str, name: str, patch: dict, *,
                     subresource: str | None = None) -> dict:
        obj, _ = self.patch(resolve_resource(resource), namespace, name, patch, MERGE_PATCH, subresource)
        return copy.deepcopy(obj)

    def set_status(self, resource: str | ResourceType, namespace: str, name: str, status: dict | None) -> dict:
        res = resolve_resource(resource)
        with self.store.lock:
            old = self.store.get(res, namespace, name)
            if old is None:
                raise ApiError.not_found(res, name)
            new = copy.deepcopy(old)
            if status is None:
                new.pop("status", None)
            else:
                new["status"] = copy.deepcopy(status)
            return copy.deepcopy(self.store.commit_update(res, old, new))

    def delete_object(self, resource: str | ResourceType, namespace: str, name: str, *,
                      force: bool = False) -> dict | None:
        res = resolve_resource(resource)
        with self.store.lock:
            old = self.store.get(res, namespace, name)
            if old is None:
                return None
            if force:
                return copy.deepcopy(self.store.commit_delete(res, old))
            obj, _ = self.delete(res, namespace, name, {})
            return copy.deepcopy(obj)

    def compact(self) -> None:
        with self.store.lock:
            self.store.feed.compact(self.store.rv)

    # -- API operations (raise ApiError) ---------------------------------------------------------

    def get(self, res: ResourceType, namespace: str, name: str) -> dict:
        with self.store.lock:
            obj = self.store.get(res, namespace, name)
            if obj is None:
                raise ApiError.not_found(res, name)
            return obj

    def _schema_warnings(self, res: ResourceType, obj: dict, field_validation: str | None) -> list[str]:
        return apply_schema(self._schemas.get((res.group, res.version, res.plural)), obj, field_validation)

    def create(self, res: ResourceType, namespace: str, body: Any, *, dry_run: bool = False,
               field_validation: str | None = None) -> tuple[dict, list[str]]:
        """POST: (the created object, Warning texts)."""
        if not isinstance(body, dict):
            raise ApiError.bad_request("the body of the request was in an unknown format")
        obj = copy.deepcopy(body)
        check_type_meta(res, obj)
        meta = obj.get("metadata")
        if meta is None:
            meta = obj["metadata"] = {}
        if not isinstance(meta, dict):
            raise ApiError.bad_request("metadata must be an object")
        if meta.get("namespace") not in (None, "", namespace):
            raise ApiError.bad_request("the namespace of the provided object does not match the namespace sent on "
                                       "the request")
        meta["namespace"] = namespace
        for key in SYSTEM_META:
            meta.pop(key, None)
        name, generate = meta.get("name"), meta.get("generateName")
        if not name and not generate:
            raise ApiError.invalid(res, "", [("FieldValueRequired", "metadata.name",
                                               "Required value: name or generateName is required")])
        if name:
            err = dns_subdomain_error(name)
            if err:
                raise ApiError.invalid(res, name, [("FieldValueInvalid", "metadata.name",
                                                    f'Invalid value: "{name}": {err}')])
        if res.status_subresource and res.custom:
            obj.pop("status", None)
        warnings = self._schema_warnings(res, obj, field_validation)
        if not res.custom:
            self._core_defaults.apply(res, obj)
        with self.store.lock:
            if not name:
                for _ in range(20):
                    candidate = generate[:58] + "".join(random.choice(GENERATE_ALPHABET) for _ in range(5))
                    if self.store.get(res, namespace, candidate) is None:
                        break
                meta["name"] = name = candidate
                err = dns_subdomain_error(name)
                if err:
                    raise ApiError.invalid(res, name, [("FieldValueInvalid", "metadata.generateName",
                                                         f'Invalid value: "{generate}": {err}')])
            if self.store.get(res, namespace, name) is not None:
                raise ApiError.already_exists(res, name)
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = now_rfc3339()
            if res.tracks_generation:
                meta["generation"] = 1
            if dry_run:
                return obj, warnings
            return self.store.commit_create(res, obj), warnings

    def update(self, res: ResourceType, namespace: str, name: str, body: Any, subresource: str | None, *,
               dry_run: bool = False, field_validation: str | None = None,
               from_patch: bool = False) -> tuple[dict, list[str]]:
        """PUT (of the object or its ``status``): (the stored object, Warning texts)."""
        if not isinstance(body, dict):
            raise ApiError.bad_request("the body of the request was in an unknown format")
        new = copy.deepcopy(body)
        if not from_patch:
            check_type_meta(res, new)
        meta = new.get("metadata")
        if not isinstance(meta, dict):
            meta = new["metadata"] = {}
        if meta.get("name") not in (None, "", name):
            raise ApiError.bad_request(f"the name of the object ({meta.get('name')}) does not match the name on "
                                       f"the URL ({name})")
        if meta.get("namespace") not in (None, "", namespace):
            raise ApiError.bad_request("the namespace of the provided object does not match the namespace sent on "
                                       "the request")
        given_rv = meta.get("resourceVersion")
        with self.store.lock:
            old = self.store.get(res, namespace, name)
            if old is None:
                raise ApiError.not_found(res, name)
            if not given_rv and not res.unconditional_update and not from_patch:
                raise ApiError.invalid(res, name, [("FieldValueInvalid", "metadata.resourceVersion",
                                                     "Invalid value: 0: must be specified for an update")])
            if given_rv and str(given_rv) != old["metadata"]["resourceVersion"]:
                raise ApiError.conflict(res, name)
            if subresource == "status":
                merged = copy.deepcopy(old)
                if "status" in new:
                    merged["status"] = new["status"]
                else:
                    merged.pop("status", None)
                new = merged
            else:
                self._keep_server_fields(res, old, new)
            if res.plural == "secrets":
                fold_string_data(new)
            warnings = self._schema_warnings(res, new, field_validation)
            if dry_run:
                preview = copy.deepcopy(new)
                preview["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
                return preview, warnings
            return self.store.commit_update(res, old, new), warnings

    @staticmethod
    def _keep_server_fields(res: ResourceType, old: dict, new: dict) -> None:
        """A write to the main resource keeps system metadata and ``.status``; a terminating
        object takes no new finalizers."""
        carry_system_meta(old, new)
        if res.status_subresource:
            if "status" in old:
                new["status"] = copy.deepcopy(old["status"])
            else:
                new.pop("status", None)
        old_fin = set(old["metadata"].get("finalizers") or [])
        added = [f for f in new["metadata"].get("finalizers") or [] if f not in old_fin]
        if old["metadata"].get("deletionTimestamp") and added:
            raise ApiError.invalid(res, new["metadata"]["name"], [(
                "FieldValueForbidden", "metadata.finalizers",
                "Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers "
                f"{json.dumps(added)}")])

    def patch(self, res: ResourceType, namespace: str, name: str, patch: Any, content_type: str,
              subresource: str | None, *, dry_run: bool = False,
              field_validation: str | None = None) -> tuple[dict, list[str]]:
        """PATCH with a JSON patch or a merge patch (strategic merge patch of core types is
        approximated by it): (the stored object, Warning texts)."""
        with self.store.lock:
            old = self.store.get(res, namespace, name)
            if old is None:
                raise ApiError.not_found(res, name)
            if content_type == JSON_PATCH:
                try:
                    patched = json_patch(old, patch)
                except PatchDecodeError as exc:
                    raise ApiError.bad_request(str(exc)) from None
                except PatchError as exc:
                    raise ApiError.unprocessable(str(exc)) from None
            else:
                if not isinstance(patch, dict):
                    raise ApiError.bad_request(
                        f"json: cannot unmarshal {type(patch).__name__} into Go value of type "
                        "map[string]interface {}")
                patched = merge_patch(old, patch)
            if not isinstance(patched, dict):
                raise ApiError.bad_request("the patched object is not a JSON object")
            meta = patched.setdefault("metadata", {})
            if not isinstance(meta, dict):
                raise ApiError.bad_request("metadata must be an object")
            meta["name"], meta["namespace"] = name, namespace
            patched["kind"], patched["apiVersion"] = res.kind, res.api_version
            if not meta.get("resourceVersion"):
                meta["resourceVersion"] = old["metadata"]["resourceVersion"]
            return self.update(res, namespace, name, patched, subresource, dry_run=dry_run,
                               field_validation=field_validation, from_patch=True)

    def delete(self, res: ResourceType, namespace: str, name: str, options: dict, *,
               dry_run: bool = False) -> tuple[dict, bool]:
        """DELETE: (the object, removed now). With finalizers it only gets a deletionTimestamp."""
        with self.store.lock:
            old = self.store.get(res, namespace, name)
            if old is None:
                raise ApiError.not_found(res, name)
            pre = options.get("preconditions") or {}
            if pre.get("uid") and pre["uid"] != old["metadata"]["uid"]:
                raise ApiError.conflict(res, name, (
                    f"Precondition failed: UID in precondition: {pre['uid']}, "
                    f"UID in object meta: {old['metadata']['uid']}"))
            if pre.get("resourceVersion") and str(pre["resourceVersion"]) != old["metadata"]["resourceVersion"]:
                raise ApiError.conflict(res, name, (
                    f"Precondition failed: ResourceVersion in precondition: {pre['resourceVersion']}, "
                    f"ResourceVersion in object meta: {old['metadata']['resourceVersion']}"))
            if dry_run:
                return old, False
            if old["metadata"].get("finalizers"):
                if old["metadata"].get("deletionTimestamp"):
                    return old, False
                new = copy.deepcopy(old)
                new["metadata"]["deletionTimestamp"] = now_rfc3339()
                new["metadata"]["deletionGracePeriodSeconds"] = 0
                # graceful deletion bumps metadata.generation, like the real registry's BeforeDelete
                return self.store.commit_update(res, old, new, bump_generation=True), False
            return self.store.commit_delete(res, old), True

    def list(self, res: ResourceType, namespace: str | None, query: dict) -> dict:
        """A list (``labelSelector``, ``fieldSelector``, ``limit`` + ``continue``) at the current resourceVersion."""
        lreqs = parse_label_selector(query.get("labelSelector"))
        freqs = parse_field_selector(query.get("fieldSelector"), res.plural, custom=res.custom)
        with self.store.lock:
            items = self.store.select(res, namespace, lreqs, freqs)
            list_rv = str(self.store.rv)
        start = 0
        if query.get("continue"):
            try:
                start = int(json.loads(base64.urlsafe_b64decode(query["continue"]))["start"])
            except Exception:
                raise ApiError.bad_request("continue key is not valid: illegal base64 data") from None
        meta: dict[str, Any] = {"resourceVersion": list_rv}
        limit = int(query.get("limit") or 0)
        if limit > 0 and start + limit < len(items):
            meta["continue"] = base64.urlsafe_b64encode(json.dumps({"start": start + limit}).encode()).decode()
            meta["remainingItemCount"] = len(items) - start - limit
            items = items[start:start + limit]
        else:
            items = items[start:]
        if not res.custom:  # core lists carry items without kind/apiVersion
            items = [{k: v for k, v in o.items() if k not in ("kind", "apiVersion")} for o in items]
        return {"kind": f"{res.kind}List", "apiVersion": res.api_version, "metadata": meta, "items": items}

    def delete_collection(self, res: ResourceType, namespace: str, query: dict, dry_run: bool) -> dict:
        lreqs = parse_label_selector(query.get("labelSelector"))
        freqs = parse_field_selector(query.get("fieldSelector"), res.plural, custom=res.custom)
        out = []
        with self.store.lock:
            for obj in self.store.select(res, namespace, lreqs, freqs):
                deleted, _ = self.delete(res, namespace, obj["metadata"]["name"], {}, dry_run=dry_run)
                out.append(deleted)
            rv = str(self.store.rv)
        return {"kind": f"{res.kind}List", "apiVersion": res.api_version, "metadata": {"resourceVersion": rv},
                "items": out}
