"""The stand-in's API server: an object store with resourceVersions and watch history, served over
plain HTTP in the Kubernetes API's wire format (paths, JSON shapes, Status errors, chunked watches).

Only what the official Python client needs for Pods, Secrets, NetworkPolicies, Namespaces, Nodes and
SelfSubjectAccessReviews. Namespaces enforce a Pod Security level as their
pod-security.kubernetes.io/enforce label says (podsecurity.py): "restricted" unless told otherwise.
NetworkPolicies are validated against the API's schema and stored; netpol.py says what they let
through, and netfilter.py enforces that on the pods' network.

The kubelet (kubelet.py) runs the pods and reports their status through the same store, so every
change a client can see arrives as a watch event, as on a real cluster.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import copy
import datetime
import json
import queue
import re
import secrets as _random
import string
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from . import podsecurity

# The namespaced resources the store holds: their kinds, and the API group/version each is served under.
KINDS = {"pods": "Pod", "secrets": "Secret", "networkpolicies": "NetworkPolicy"}
API_VERSIONS = {"pods": "v1", "secrets": "v1", "networkpolicies": "networking.k8s.io/v1"}
HISTORY = 10_000  # watch events kept; a watch from before the oldest gets 410 Gone
USER = "system:serviceaccount:default:standin"  # who "you" are in Forbidden messages
VERSION = {"major": "1", "minor": "31", "gitVersion": "v1.31.0", "gitCommit": "standin", "gitTreeState": "clean"}
VERSION.update(buildDate="2024-08-13T07:28:49Z", goVersion="go1.22.5", compiler="gc", platform="linux/amd64")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def now(offset: float = 0) -> str:
    moment = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=offset)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiError(Exception):
    """An error the API answers with a `kind: Status` body."""

    def __init__(self, code: int, reason: str, message: str, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> dict[str, Any]:
        body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": self.message}
        body.update(reason=self.reason, code=self.code)
        if self.details:
            body["details"] = self.details
        return body


def not_found(resource: str, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{resource} "{name}" not found', {"name": name, "kind": resource})


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def invalid(kind: str, name: str, field_path: str, problem: str) -> ApiError:
    details = {"name": name, "kind": kind, "causes": [{"reason": "FieldValueInvalid", "message": problem}]}
    details["causes"][0]["field"] = field_path
    return ApiError(422, "Invalid", f'{kind} "{name}" is invalid: {field_path}: {problem}', details)


# ---------------------------------------------------------------- selectors


def parse_selector(text: str | None, what: str = "label") -> list[tuple[str, str, str]]:
    """Equality-based selectors ("a=b,c!=d,e,!f") as (key, op, value); set-based ones are a 400."""
    terms = []
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        match = re.fullmatch(r"(!?)([A-Za-z0-9._/-]+)\s*(?:(==|=|!=)\s*([A-Za-z0-9._-]*))?", part)
        if not match or (match[1] and match[3]) or (what == "field" and not match[3]):
            raise bad_request(f"unable to parse requirement: {part!r} (the stand-in knows =, ==, !=, key, !key)")
        bang, key, op, value = match.groups()
        terms.append((key, op or ("!" if bang else "exists"), value or ""))
    return terms


def _field(obj: dict[str, Any], path: str) -> str:
    for part in path.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return "" if obj is None else str(obj)


def selected(obj: dict[str, Any], labels: list, fields: list) -> bool:
    have = obj["metadata"].get("labels") or {}
    for key, op, value in labels:
        found = have.get(key)
        ok = {
            "=": found == value,
            "==": found == value,
            "!=": found != value,
            "exists": key in have,
            "!": key not in have,
        }
        if not ok[op]:
            return False
    for key, op, value in fields:
        if (_field(obj, key) == value) != (op in ("=", "==")):
            return False
    return True


# ---------------------------------------------------------------- the store


@dataclass(eq=False)
class Watcher:
    resource: str
    namespace: str | None  # None: every namespace
    labels: list
    fields: list
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # (type, object); None ends it

    def wants(self, obj: dict[str, Any]) -> bool:
        namespace = self.namespace is None or obj["metadata"].get("namespace") == self.namespace
        return namespace and selected(obj, self.labels, self.fields)


class Store:
    """Objects by (resource, namespace, name), one resourceVersion counter across them all (like etcd's
    revision), and the recent events for watches. Stored objects are never changed in place: an update
    stores a changed copy, so history and watch queues can share them."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.deleted = threading.Event()  # set by each deletion: the garbage collector looks again
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.rv = 0
        self.history: collections.deque[tuple[int, str, str, dict[str, Any]]] = collections.deque()
        self.oldest = 0  # events after this resourceVersion are all in history
        self.watchers: set[Watcher] = set()
        self.listeners: list[Callable[[], None]] = []  # told of every change (quick: under the lock)

    def _record(self, kind: str, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        self.history.append((self.rv, kind, resource, obj))
        if len(self.history) > HISTORY:
            self.oldest = self.history.popleft()[0]
        for watcher in self.watchers:
            if watcher.resource == resource and watcher.wants(obj):
                watcher.events.put((kind, obj))
        for listener in self.listeners:
            listener()
        return copy.deepcopy(obj)

    def _next(self, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)

    def get(self, resource: str, namespace: str, name: str) -> dict[str, Any] | None:
        with self.lock:
            obj = self.objects.get((resource, namespace, name))
            return copy.deepcopy(obj) if obj is not None else None

    def list(self, resource: str, namespace: str | None = None) -> tuple[list[dict[str, Any]], str]:
        with self.lock:
            items = [o for (r, ns, _), o in self.objects.items() if r == resource and namespace in (None, ns)]
            return copy.deepcopy(items), str(self.rv)

    def uids(self) -> set[str]:
        with self.lock:
            return {o["metadata"]["uid"] for o in self.objects.values()}

    def create(self, resource: str, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        with self.lock:
            key = (resource, meta["namespace"], meta["name"])
            if key in self.objects:
                raise ApiError(
                    409, "AlreadyExists", f'{resource} "{meta["name"]}" already exists', {"name": meta["name"]}
                )
            self._next(obj)
            self.objects[key] = obj
            return self._record("ADDED", resource, obj)

    def update(
        self, resource: str, namespace: str, name: str, change: Callable[[dict], None], uid: str | None = None
    ) -> dict[str, Any] | None:
        """Apply `change` to a copy of the object and store it (a MODIFIED event); None if it is gone
        (or, given `uid`, was replaced by another object of the same name)."""
        with self.lock:
            current = self.objects.get((resource, namespace, name))
            if current is None or uid not in (None, current["metadata"]["uid"]):
                return None
            changed = copy.deepcopy(current)
            change(changed)
            if changed == current:
                return changed
            self._next(changed)
            self.objects[(resource, namespace, name)] = changed
            return self._record("MODIFIED", resource, changed)

    def delete(self, resource: str, namespace: str, name: str, uid: str | None = None) -> dict[str, Any] | None:
        with self.lock:
            current = self.objects.get((resource, namespace, name))
            if current is None or uid not in (None, current["metadata"]["uid"]):
                return None
            del self.objects[(resource, namespace, name)]
            self.deleted.set()
            gone = copy.deepcopy(current)
            self._next(gone)  # a DELETED event carries the deletion's resourceVersion
            return self._record("DELETED", resource, gone)

    def watch(self, watcher: Watcher, since: str | None) -> None:
        """Subscribe, first queueing what the watcher missed: the events after `since`, or (no or "0"
        resourceVersion) an ADDED event for each current object, as the API's watch cache does."""
        with self.lock:
            if since not in (None, "", "0"):
                if not since.isdigit():
                    raise bad_request(f'resourceVersion: Invalid value: "{since}": must be a number')
                if int(since) < self.oldest:
                    raise ApiError(410, "Expired", f"too old resource version: {since} ({self.oldest})")
                missed = [(k, o) for rv, k, r, o in self.history if rv > int(since) and r == watcher.resource]
            else:
                current = [o for (r, _, _), o in self.objects.items() if r == watcher.resource]
                missed = [("ADDED", o) for o in sorted(current, key=lambda o: int(o["metadata"]["resourceVersion"]))]
            for kind, obj in missed:
                if watcher.wants(obj):
                    watcher.events.put((kind, obj))
            self.watchers.add(watcher)

    def unwatch(self, watcher: Watcher) -> None:
        with self.lock:
            self.watchers.discard(watcher)

    def drop_watches(self) -> None:
        with self.lock:
            for watcher in self.watchers:
                watcher.events.put(None)

    def compact(self) -> None:
        with self.lock:
            self.history.clear()
            self.oldest = self.rv


# ---------------------------------------------------------------- patches


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (strategic merge patches are treated the same: fine for maps)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(target: Any, operations: list[dict[str, Any]]) -> Any:
    """RFC 6902 add / replace / remove / test, enough for labels and Secret data."""
    doc = copy.deepcopy(target)
    for op in operations:
        *parents, last = [unquote(p).replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node = doc
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        key: Any = int(last) if isinstance(node, list) and last != "-" else last
        if op["op"] in ("add", "replace"):
            if isinstance(node, list) and op["op"] == "add":
                node.insert(len(node) if key == "-" else key, op["value"])
            else:
                node[key] = op["value"]
        elif op["op"] == "remove":
            del node[key]
        elif op["op"] == "test" and node.get(key) != op["value"]:
            raise ApiError(422, "Invalid", f"the test of {op['path']} failed")
    return doc


# ---------------------------------------------------------------- the API


@dataclass
class Stream:
    """A streamed answer (watch events, a followed log), sent with chunked transfer encoding."""

    chunks: Iterator[bytes]
    content_type: str = "application/json"


class Served(tuple):
    """(method, path) of a request served; `.query` holds its query parameters."""

    query: dict[str, str]

    def __new__(cls, method: str, path: str, query: dict[str, str]) -> Served:
        served = super().__new__(cls, (method, path))
        served.query = query
        return served


_VERBS = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}


class Api:
    """Routes requests to the store and the kubelet; checks the scripted RBAC denials first."""

    def __init__(self, store: Store, kubelet: Any, namespaces: tuple[str, ...], pod_security: str = "restricted"):
        self.store, self.kubelet = store, kubelet
        self.namespaces = {ns: str(uuid.uuid4()) for ns in namespaces}
        # Each namespace's pod-security.kubernetes.io/enforce level ("privileged": none enforced).
        self.pod_security = dict.fromkeys(namespaces, pod_security)
        self.denied: set[tuple[str, str, str]] = set()  # (verb, resource[/subresource], namespace or "")
        self.requests: list[Served] = []
        # Kubernetes' garbage collector runs on its own: an owner removed by the kubelet (a pod whose
        # graceful deletion ended) takes its dependents too, not only one deleted through the API.
        self._closed = threading.Event()
        self._collector = threading.Thread(target=self._collect_after_deletions, name="standin-gc", daemon=True)
        self._collector.start()

    def close(self) -> None:
        self._closed.set()
        self.store.deleted.set()
        self._collector.join(10)

    def _collect_after_deletions(self) -> None:
        while True:
            self.store.deleted.wait()
            if self._closed.is_set():
                return
            self.store.deleted.clear()
            for namespace in list(self.namespaces):
                with contextlib.suppress(Exception):  # an object gone meanwhile: the next round sees the rest
                    self._collect_garbage(namespace)

    # -- RBAC

    def allowed(self, verb: str, resource: str, namespace: str) -> bool:
        return not any(v in ("*", verb) and r in ("*", resource) and ns in ("*", namespace) for v, r, ns in self.denied)

    def _authorize(self, verb: str, resource: str, namespace: str, name: str | None) -> None:
        if not self.allowed(verb, resource, namespace):
            what = f'{resource.split("/")[0]} "{name}"' if name else resource.split("/")[0]
            scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
            group = API_VERSIONS.get(resource.split("/")[0], "v1").rpartition("/")[0]
            message = (
                f'{what} is forbidden: User "{USER}" cannot {verb} resource "{resource}" in API group "{group}" {scope}'
            )
            raise ApiError(403, "Forbidden", message, {"name": name, "kind": resource.split("/")[0]})

    # -- routing

    def handle(self, method: str, path: str, query: dict[str, str], body: Any, content_type: str) -> Any:
        """(status code, JSON object) or a Stream, or raises ApiError."""
        self.requests.append(Served(method, path, query))
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if path.rstrip("/") == "/version" and method == "GET":
            return 200, VERSION
        if parts[:4] == ["apis", "authorization.k8s.io", "v1", "selfsubjectaccessreviews"] and method == "POST":
            return self._access_review(body)
        if parts[:2] == ["api", "v1"]:
            version, rest = "v1", parts[2:]
        elif parts[:3] == ["apis", "networking.k8s.io", "v1"]:
            version, rest = "networking.k8s.io/v1", parts[3:]
        else:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        served = {r for r, v in API_VERSIONS.items() if v == version}  # the resources under this path
        watch = query.get("watch") in ("true", "1")
        if version == "v1" and rest[:1] == ["nodes"] and method == "GET" and len(rest) <= 2:
            self._authorize("get" if len(rest) == 2 else ("watch" if watch else "list"), "nodes", "", None)
            node = self.kubelet.node()
            if len(rest) == 2:
                if rest[1] != node["metadata"]["name"]:
                    raise not_found("nodes", rest[1])
                return 200, node
            return 200, {"kind": "NodeList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": [node]}
        if len(rest) == 1 and rest[0] in served and method == "GET":  # every namespace
            return self._collection(method, rest[0], None, query, body)
        if rest[:1] != ["namespaces"] or len(rest) < 2:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        namespace = rest[1]
        if len(rest) == 2 and method == "GET" and version == "v1":
            self._authorize("get", "namespaces", "", namespace)
            return 200, self._namespace(namespace)
        if len(rest) < 3 or rest[2] not in served:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        resource = rest[2]
        if len(rest) == 3:
            return self._collection(method, resource, namespace, query, body)
        name = rest[3]
        if len(rest) == 5 and resource == "pods" and rest[4] in ("log", "status") and method == "GET":
            self._authorize("get", f"pods/{rest[4]}", namespace, name)
            return (
                self._log(namespace, name, query) if rest[4] == "log" else (200, self._get(resource, namespace, name))
            )
        if len(rest) != 4:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if method not in _VERBS or method == "POST":
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on {path}")
        self._authorize(_VERBS[method], resource, namespace, name)
        self._namespace(namespace)
        if method == "GET":
            return 200, self._get(resource, namespace, name)
        if method == "DELETE":
            return self._delete(resource, namespace, name, query, body or {})
        return 200, self._update(resource, namespace, name, method, body, content_type)

    def _namespace(self, name: str) -> dict[str, Any]:
        if name not in self.namespaces:
            raise not_found("namespaces", name)
        meta = {"name": name, "uid": self.namespaces[name], "resourceVersion": "1", "labels": {}}
        meta["labels"]["kubernetes.io/metadata.name"] = name
        if self.pod_security.get(name, "privileged") != "privileged":
            meta["labels"][podsecurity.ENFORCE_LABEL] = self.pod_security[name]
        spec, status = {"finalizers": ["kubernetes"]}, {"phase": "Active"}
        return {"kind": "Namespace", "apiVersion": "v1", "metadata": meta, "spec": spec, "status": status}

    def _get(self, resource: str, namespace: str, name: str) -> dict[str, Any]:
        obj = self.store.get(resource, namespace, name)
        if obj is None:
            raise not_found(resource, name)
        return obj

    def _collection(self, method: str, resource: str, namespace: str | None, query: dict, body: Any) -> Any:
        watch = query.get("watch") in ("true", "1")
        verb = {"GET": "watch" if watch else "list", "POST": "create", "DELETE": "deletecollection"}.get(method)
        if verb is None:
            raise ApiError(405, "MethodNotAllowed", f"{method} on a collection is not supported by the stand-in")
        self._authorize(verb, resource, namespace or "", None)
        if namespace is not None:
            self._namespace(namespace)
        if method == "POST":
            return 201, self._create(resource, namespace or "", body)
        labels = parse_selector(query.get("labelSelector"))
        fields = parse_selector(query.get("fieldSelector"), "field")
        if watch:
            return self._watch(Watcher(resource, namespace, labels, fields), query)
        items, rv = self.store.list(resource, namespace)
        items = sorted((o for o in items if selected(o, labels, fields)), key=lambda o: o["metadata"]["name"])
        if method == "DELETE" and namespace is not None:
            return self._delete_collection(resource, namespace, query, body or {}, items)
        for item in items:  # a list's items carry no kind
            item.pop("kind", None)
            item.pop("apiVersion", None)
        return 200, {
            "kind": KINDS[resource] + "List",
            "apiVersion": API_VERSIONS[resource],
            "metadata": {"resourceVersion": rv},
            "items": items,
        }

    # -- create, update, delete

    def _create(self, resource: str, namespace: str, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise bad_request("the body of the request was in an unknown format")
        obj = copy.deepcopy(body)
        obj["kind"], obj["apiVersion"] = KINDS[resource], API_VERSIONS[resource]
        meta = obj.setdefault("metadata", {})
        if meta.get("namespace", namespace) != namespace:
            raise bad_request("the namespace of the provided object does not match the namespace sent on the request")
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + "".join(_random.choice(string.ascii_lowercase) for _ in range(5))
        name = meta.get("name") or ""
        if not name:
            raise invalid(KINDS[resource], "", "metadata.name", "Required value: name or generateName is required")
        if len(name) > 253 or not _DNS_SUBDOMAIN.fullmatch(name):
            raise invalid(
                KINDS[resource], name, "metadata.name", f'Invalid value: "{name}": a lowercase RFC 1123 subdomain'
            )
        meta.update(namespace=namespace, uid=str(uuid.uuid4()), creationTimestamp=now())
        for key in ("resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(key, None)
        if resource == "secrets":
            _encode_string_data(obj)
            obj.setdefault("type", "Opaque")
            created = self.store.create(resource, obj)
            self.kubelet.secret_changed(namespace, name)
        elif resource == "networkpolicies":
            _validate(obj)
            created = self.store.create(resource, obj)
        else:
            # Pod Security admission first, as on a real API server: a refused pod is never defaulted.
            refused = podsecurity.refusal(obj, self.pod_security.get(namespace, "privileged"))
            if refused:
                raise ApiError(403, "Forbidden", refused, {"name": name, "kind": "pods"})
            self.kubelet.admit(obj)  # defaults and validation (422), as the API's admission would
            created = self.store.create(resource, obj)
            self.kubelet.pod_created(created)
            self._collect_garbage(namespace)  # a pod whose owner is gone already goes at once
        return created

    def _update(self, resource: str, namespace: str, name: str, method: str, body: Any, content_type: str) -> Any:
        current = self._get(resource, namespace, name)
        if method == "PUT":
            new = copy.deepcopy(body)
            sent_rv = (new.get("metadata") or {}).get("resourceVersion")
            if sent_rv and sent_rv != current["metadata"]["resourceVersion"]:
                message = (
                    f'Operation cannot be fulfilled on {resource} "{name}": the object has been modified; '
                    "please apply your changes to the latest version and try again"
                )
                raise ApiError(409, "Conflict", message, {"name": name, "kind": resource})
        elif "json-patch" in content_type:
            new = json_patch(current, body)
        elif "merge-patch" in content_type:
            new = merge_patch(current, body)
        else:
            raise ApiError(415, "UnsupportedMediaType", f"the stand-in does not take {content_type} patches")
        meta = new.setdefault("metadata", {})
        if meta.get("name", name) != name:
            raise bad_request("the name of the object does not match the name on the URL")
        if resource == "secrets" and current.get("immutable"):
            raise invalid("Secret", name, "data", "Forbidden: field is immutable when `immutable` is set")
        if resource == "pods" and new.get("spec") != current["spec"]:
            raise invalid("Pod", name, "spec", "Forbidden: pod updates may not change fields other than labels")
        for key in ("uid", "creationTimestamp", "namespace", "name", "deletionTimestamp"):
            if key in current["metadata"]:
                meta[key] = current["metadata"][key]
        if resource == "pods":
            new["status"] = current.get("status")  # kept: status is the kubelet's
        elif resource == "secrets":
            _encode_string_data(new)
        new["kind"], new["apiVersion"] = KINDS[resource], API_VERSIONS[resource]
        if resource == "networkpolicies":
            _validate(new)

        def replace(obj: dict[str, Any]) -> None:
            obj.clear()
            obj.update(new)

        updated = self.store.update(resource, namespace, name, replace, uid=current["metadata"]["uid"])
        if updated is None:
            raise not_found(resource, name)
        if resource == "secrets":
            self.kubelet.secret_changed(namespace, name)
        return updated

    def _delete(self, resource: str, namespace: str, name: str, query: dict, options: dict) -> Any:
        current = self._get(resource, namespace, name)
        preconditions = options.get("preconditions") or {}
        for key in ("uid", "resourceVersion"):
            if preconditions.get(key) and preconditions[key] != current["metadata"][key]:
                message = f"Precondition failed: {key} in precondition: {preconditions[key]}, {key} in object meta: "
                raise ApiError(409, "Conflict", message + current["metadata"][key], {"name": name, "kind": resource})
        policy = query.get("propagationPolicy") or options.get("propagationPolicy") or "Background"
        grace = query.get("gracePeriodSeconds", options.get("gracePeriodSeconds"))
        if resource == "pods":
            answer = self.delete_pod(namespace, name, _int(grace))
        else:
            gone = self.store.delete(resource, namespace, name, uid=current["metadata"]["uid"])
            if gone is None:
                raise not_found(resource, name)
            if resource == "secrets":
                self.kubelet.secret_changed(namespace, name)
            details = {"name": name, "kind": resource, "uid": gone["metadata"]["uid"]}
            answer = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details}
        if policy != "Orphan":
            self._collect_garbage(namespace)
        return 200, answer

    def _delete_collection(self, resource: str, namespace: str, query: dict, options: dict, selected_items: list):
        grace = query.get("gracePeriodSeconds", options.get("gracePeriodSeconds"))
        deleted = []
        for item in selected_items:
            with contextlib.suppress(ApiError):  # gone meanwhile
                deleted.append(self._remove(resource, namespace, item["metadata"]["name"], _int(grace)))
        if (query.get("propagationPolicy") or options.get("propagationPolicy")) != "Orphan":
            self._collect_garbage(namespace)
        meta = {"resourceVersion": str(self.store.rv)}
        listed = {"kind": KINDS[resource] + "List", "apiVersion": API_VERSIONS[resource], "metadata": meta}
        return 200, {**listed, "items": deleted}

    def delete_pod(self, namespace: str, name: str, grace: int | None) -> dict[str, Any]:
        """Graceful deletion: a pod with a running container is marked (deletionTimestamp, MODIFIED)
        and the kubelet stops it within `grace` seconds, then removes it (DELETED); any other pod, or
        grace 0, is removed at once (its container killed and removed first)."""
        pod = self._get("pods", namespace, name)
        if pod["metadata"].get("deletionTimestamp"):
            return pod  # being deleted already
        if grace is None:
            grace = int(pod["spec"].get("terminationGracePeriodSeconds", 30))
        uid = pod["metadata"]["uid"]
        if grace > 0 and self.kubelet.running(uid):

            def mark(obj: dict[str, Any]) -> None:
                obj["metadata"].update(deletionTimestamp=now(grace), deletionGracePeriodSeconds=grace)

            marked = self.store.update("pods", namespace, name, mark, uid=uid)
            if marked is not None:
                self.kubelet.terminate(uid, grace)
                return marked
        return self.kubelet.forget(uid, namespace, name) or pod  # (None: removed meanwhile, by the pod's thread)

    def _collect_garbage(self, namespace: str) -> None:
        """Kubernetes' garbage collector (background): delete objects whose owners (of the kinds held
        here) are all gone, in a cascade."""
        while True:
            uids, found = self.store.uids(), []
            for resource in KINDS:
                for obj in self.store.list(resource, namespace)[0]:
                    owners = [
                        o for o in obj["metadata"].get("ownerReferences") or [] if o.get("kind") in KINDS.values()
                    ]
                    if (
                        owners
                        and not obj["metadata"].get("deletionTimestamp")
                        and all(o["uid"] not in uids for o in owners)
                    ):
                        found.append((resource, obj["metadata"]["name"]))
            if not found:
                return
            for resource, name in found:
                with contextlib.suppress(ApiError):  # gone meanwhile
                    self._remove(resource, namespace, name, None)

    def _remove(self, resource: str, namespace: str, name: str, grace: int | None) -> dict[str, Any]:
        if resource == "pods":
            return self.delete_pod(namespace, name, grace)
        gone = self.store.delete(resource, namespace, name)
        if gone is None:
            raise not_found(resource, name)
        if resource == "secrets":
            self.kubelet.secret_changed(namespace, name)
        return gone

    # -- watch, log, access reviews

    def _watch(self, watcher: Watcher, query: dict[str, str]) -> Stream:
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        try:
            self.store.watch(watcher, query.get("resourceVersion"))
        except ApiError as e:
            if e.code != 410:
                raise
            # The real API answers 200 and sends the expiry as an ERROR event, then ends the stream.
            return Stream(iter([_event("ERROR", e.status())]))
        return Stream(self._events(watcher, timeout, bookmarks))

    def _events(self, watcher: Watcher, timeout: float | None, bookmarks: bool) -> Iterator[bytes]:
        deadline = time.monotonic() + timeout if timeout else None  # timeoutSeconds=0: none
        try:
            while True:
                try:
                    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                    item = watcher.events.get(timeout=wait)
                except queue.Empty:  # timeoutSeconds is up: the stream ends (a bookmark first, if allowed)
                    if bookmarks:
                        meta = {"resourceVersion": str(self.store.rv)}
                        yield _event(
                            "BOOKMARK",
                            {
                                "kind": KINDS[watcher.resource],
                                "apiVersion": API_VERSIONS[watcher.resource],
                                "metadata": meta,
                            },
                        )
                    return
                if item is None:  # dropped
                    return
                yield _event(*item)
        finally:
            self.store.unwatch(watcher)

    def _log(self, namespace: str, name: str, query: dict[str, str]) -> Any:
        pod = self._get("pods", namespace, name)
        container = pod["spec"]["containers"][0]["name"]
        if query.get("container", container) != container:
            raise bad_request(f"container {query['container']} is not valid for pod {name}")
        tail = int(query["tailLines"]) if query.get("tailLines") else None
        chunks = self.kubelet.log(pod, follow=query.get("follow") in ("true", "1"), tail=tail)
        return Stream(chunks, "text/plain")

    def _access_review(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        attributes = (body.get("spec") or {}).get("resourceAttributes") or {}
        resource = attributes.get("resource", "")
        if attributes.get("subresource"):
            resource += "/" + attributes["subresource"]
        allowed = self.allowed(attributes.get("verb", ""), resource, attributes.get("namespace", ""))
        review = copy.deepcopy(body)
        review.update(kind="SelfSubjectAccessReview", apiVersion="authorization.k8s.io/v1")
        review.setdefault("metadata", {})["creationTimestamp"] = None
        review["status"] = {"allowed": allowed} if allowed else {"allowed": False, "reason": ""}
        return 201, review


def _validate(obj: dict[str, Any]) -> None:
    """The API's validation of an object against its OpenAPI schema (422 Invalid), through
    kubernetes-validate. Not strict: a real API server drops unknown fields with a warning."""
    import kubernetes_validate

    try:
        kubernetes_validate.validate(copy.deepcopy(obj), VERSION["gitVersion"].lstrip("v"), strict=False)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.path) or "spec"
        name = (obj.get("metadata") or {}).get("name", "")
        raise invalid(obj["kind"], name, path, f"Invalid value: {e.message}") from None


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _event(kind: str, obj: dict[str, Any]) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


def _encode_string_data(secret: dict[str, Any]) -> None:
    """stringData is write-only: the API merges it into data (base64) and never returns it."""
    for key, value in (secret.pop("stringData", None) or {}).items():
        secret.setdefault("data", {})[key] = base64.b64encode(value.encode()).decode("ascii")


# ---------------------------------------------------------------- HTTP


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive and chunked responses, as the client's urllib3 pool expects
    server: HttpServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet: tests read cluster.requests instead
        pass

    def _serve(self) -> None:
        url = urlsplit(self.path)
        query = dict(parse_qsl(url.query))
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
            answer = self.server.api.handle(self.command, url.path, query, body, self.headers.get("Content-Type", ""))
        except ApiError as e:
            answer = e.code, e.status()
        except (ValueError, KeyError, TypeError, IndexError) as e:
            answer = 400, bad_request(f"the stand-in could not take this request: {e!r}").status()
        except Exception as e:  # a bug in the stand-in: say so rather than drop the connection
            answer = 500, ApiError(500, "InternalError", f"stand-in error: {e!r}").status()
        if isinstance(answer, Stream):
            self._stream(answer)
        else:
            self._send(*answer)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve

    def _send(self, code: int, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, stream: Stream) -> None:
        self.send_response(200)
        self.send_header("Content-Type", stream.content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for chunk in stream.chunks:
                if chunk:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client went away
            self.close_connection = True
        finally:
            close = getattr(stream.chunks, "close", None)
            if close is not None:
                close()


class HttpServer(ThreadingHTTPServer):
    daemon_threads = True  # a watch still open at close must not hold the process

    def __init__(self, api: Api):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.api = api
        self.thread = threading.Thread(target=self.serve_forever, name="kubestandin-api", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that hung up is no error
            super().handle_error(request, client_address)
