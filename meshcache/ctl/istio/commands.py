"""`meshcache istio ...`: render the manifests, write the module's OCI image, issue the xDS TLS
certificates, validate offline."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from meshcache.contract import oci
from meshcache.contract.paths import FILTER_WASM, REPO_ROOT

from . import filter_host, kustomize, render

# crossref, validate (jsonschema, the Kubernetes schemas) and xds_tls are imported by the commands
# that use them: every `meshcache` run (status, policy, up) builds this parser, and they would
# add about a fifth of a second to each.


def register(subparsers: Any) -> None:
    istio = subparsers.add_parser("istio", help="Istio manifests, the filter's OCI image, offline validation")
    sub = istio.add_subparsers(dest="istio_command", required=True)

    r = sub.add_parser("render", help="write the Istio manifests for a namespace and colour",
                       description="Builds istio/ (or an overlay) for a namespace and colours, pinned to the "
                                   "built module's image digest; writes both IstioOperator steps and a preview "
                                   "of what the control plane serves istiod for a policy snapshot (from "
                                   "--control-plane, --snapshot, or else the demo policies).")
    r.add_argument("--namespace", default=render.BASE_NAMESPACE)
    r.add_argument("--color", help=f"colour of this rollout (default route; default {render.BASE_COLOR}); "
                                    "meshcache's own engine only")
    r.add_argument("--also-color", action="append", default=[], metavar="COLOR",
                   help="a colour already live: keep its subset and header route (repeatable)")
    r.add_argument("--overlay", type=Path, default=render.BASE_DIR,
                   help="kustomization directory (default istio/base; e.g. istio/overlays/basic): from the "
                        "current directory, else the package's (istio/overlays/kserve or just kserve)")
    r.add_argument("--ingress-host", default=render.INGRESS_HOST,
                   help="external host of the ingress Gateway and its VirtualService")
    r.add_argument("--image-digest", help="manifest digest of the pushed filter image (64 hex); default: "
                                          "the digest of `meshcache istio oci-layout` for the built module")
    r.add_argument("--filter-repository", default=render.FILTER_REPOSITORY, help="registry/repository of the image")
    r.add_argument("--module", type=Path, default=FILTER_WASM, help="the built filter module")
    r.add_argument("--filter", choices=filter_host.FILTERS, default="wasm",
                   help="the cache's host in the sidecars: wasm (the proxy-wasm filter, any Istio) or native "
                        "(the Envoy dynamic module; istio-proxy links it from Istio 1.31)")
    r.add_argument("--istio-version", default=filter_host.ISTIO_VERSION,
                   help=f"the mesh's Istio version (default {filter_host.ISTIO_VERSION}, what the manifests target)")
    r.add_argument("--native-image", metavar="REPO@sha256:DIGEST",
                   help="--filter native: the image an init container copies the module from (pinned by digest; "
                        "holds /meshcache/modules/<module> and sh, cp, sha256sum)")
    r.add_argument("--engine-image", help="image of meshcache's engine (default the manifests' placeholder)")
    r.add_argument("--control-plane-image", help="image of the control plane (default the manifests' placeholder)")
    r.add_argument("--allow-principal", action="append", default=[], metavar="PRINCIPAL",
                   help="a caller the cached workloads' AuthorizationPolicy admits, besides meshcache-client and "
                        "the ingress gateway (repeatable): spiffe://cluster.local/ns/NS/sa/SA, "
                        "cluster.local/ns/NS/sa/SA or NS/SA")
    r.add_argument("--ingress-principal", action="append", default=[], metavar="PRINCIPAL[,PRINCIPAL]",
                   help="the ingress gateway's identity, in the same forms (repeatable, or a comma list); replaces "
                        f"the default {render.INGRESS_PRINCIPAL} (istioctl's gateway); a Helm-installed gateway "
                        "`helm install NAME istio/gateway -n NS` runs as NS/NAME")
    r.add_argument("--authz", choices=render.AUTHZ_MODES, default="allow-callers",
                   help="allow-callers (default): an ALLOW AuthorizationPolicy on the cached pods, the inference "
                        "ports for meshcache-client, the ingress gateway and --allow-principal only, every other "
                        "port for any caller; none: no AuthorizationPolicy (authorization is yours)")
    r.add_argument("--engine-selector", action="append", default=[], metavar="KEY=VALUE",
                   help="a pod label of the workloads whose sidecars cache (repeatable; all must match; default "
                        "the overlay's: app=meshcache-engine in istio/base)")
    r.add_argument("--engine-port", action="append", default=[], metavar="KEY=PORT",
                   help="the cached workloads' container ports: http=N, grpc=N (grpc=none: REST only); and the "
                        "ports of their Service if different: service-http=N, service-grpc=N (repeatable)")
    r.add_argument("--engine-service", metavar="NAME",
                   help="the Service callers use to reach the cached workloads (its DestinationRule); default the "
                        "overlay's")
    r.add_argument("--mesh-tls13", action="store_true",
                   help="also set the mesh-wide meshMTLS.minProtocolVersion TLSV1_3 in the Istio install files "
                        "(a change for every workload in the mesh; off by default)")
    r.add_argument("--delivery", choices=render.DELIVERIES, default="mcp",
                   help="how istiod gets the EnvoyFilters/TrafficExtensions: mcp (default: istiod reads the control "
                        "plane as a configSources entry) or kube (the control plane writes them through the API "
                        "server with a namespaced Role; istiod is not reconfigured)")
    src = r.add_mutually_exclusive_group()
    src.add_argument("--control-plane", metavar="URL", help="read the current snapshot from this API")
    src.add_argument("--snapshot", type=Path, metavar="FILE", help="a `GET /v1/snapshot` body or snapshot record")
    r.add_argument("--token", default=os.environ.get("MESHCACHE_TOKEN", ""),
                   help="API token for --control-plane (default $MESHCACHE_TOKEN)")
    r.add_argument("--out", type=Path, help="directory for namespace.yaml, meshcache-istio.yaml, "
                                            "istio-operator.yaml (fresh Istio, step 1), istio-operator-mcp.yaml "
                                            "(step 2), istio-operator-existing.yaml and istiod-values.yaml (an "
                                            "existing Istio: istioctl overlay, Helm values), mcp-preview.yaml "
                                            "(--delivery kube: kube-preview.yaml and no istiod files) "
                                            "(default: the manifests on stdout)")
    r.add_argument("--update-base", action="store_true",
                   help="instead: re-pin the committed istio/base to the built module")
    r.set_defaults(func=_render)

    o = sub.add_parser("oci-layout", help="write the filter module as an OCI image layout (for oras/skopeo)")
    o.add_argument("--module", type=Path, default=FILTER_WASM)
    o.add_argument("--out", type=Path, required=True)
    o.add_argument("--tag", default="latest")
    o.set_defaults(func=_oci_layout)

    c = sub.add_parser("xds-certs", help="a CA and the control plane's xDS server certificate (TLS for istiod)")
    c.add_argument("--namespace", default=render.BASE_NAMESPACE)
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--days", type=int, default=365)
    ca = c.add_mutually_exclusive_group()
    ca.add_argument("--new-ca", action="store_true",
                    help="start a new CA (rotation): the old one stays in ca-bundle.crt until --drop-old-ca")
    ca.add_argument("--drop-old-ca", action="store_true",
                    help="end a rotation: ca-bundle.crt without the old CA (no new server certificate)")
    c.set_defaults(func=_xds_certs)

    v = sub.add_parser("validate", help="validate manifest files against Istio's CRDs and Kubernetes schemas")
    v.add_argument("files", type=Path, nargs="+", metavar="FILE|DIR",
                   help="manifests; a directory: every *.yaml / *.yml in it (recursively)")
    v.add_argument("--module", type=Path, default=FILTER_WASM, help="also check the pins against this module")
    v.add_argument("--workload", type=Path, action="append", default=[], metavar="FILE",
                   help="your cached workloads' manifests (overlays kserve, triton; e.g. `kubectl get deploy,svc "
                        "NAME -o yaml`), for the cross-references only (repeatable)")
    v.add_argument("--allow-principal", action="append", default=[], metavar="PRINCIPAL",
                   help="a caller principal whose ServiceAccount lives outside these manifests (as `render "
                        "--allow-principal` records in the meshcache.io/allowed-principals annotation; repeatable)")
    v.set_defaults(func=_validate)


def overlay_dir(given: Path) -> Path:
    """`--overlay`: from the current directory, else the package's (`istio/overlays/kserve` or
    `kserve`), so the documented commands work outside the checkout's root."""
    for candidate in (given, REPO_ROOT / given, render.ISTIO_DIR / "overlays" / given):
        if (candidate / kustomize.KUSTOMIZATION).is_file():
            return candidate
    overlays = sorted(p.parent.name for p in (render.ISTIO_DIR / "overlays").glob(f"*/{kustomize.KUSTOMIZATION}"))
    raise ValueError(f"--overlay {given}: no {kustomize.KUSTOMIZATION} there, nor in {REPO_ROOT / given} "
                     f"(the package's overlays: {', '.join(overlays)})")


def _render(args: argparse.Namespace) -> int:
    if args.update_base:
        for path in render.update_base(args.module):
            print(f"updated {path}")
        return 0
    try:
        filter_host.check(args.filter, args.istio_version)  # before reading a control plane
    except ValueError as exc:
        print(f"meshcache istio render: {exc}", file=sys.stderr)
        return 2
    if args.control_plane:
        if not args.token:
            print("meshcache istio render: --control-plane needs --token or $MESHCACHE_TOKEN", file=sys.stderr)
            return 2
        plugin_config = render.plugin_config_from_api(args.control_plane, args.token)
    elif args.snapshot:
        plugin_config = render.plugin_config_from_file(args.snapshot)
    else:
        plugin_config = render.demo_plugin_config()
    try:
        args.overlay = overlay_dir(args.overlay)
        opts = render.RenderOptions(
            namespace=args.namespace, color=args.color, also_colors=tuple(args.also_color),
            plugin_config=plugin_config, module_path=args.module, image_digest=args.image_digest,
            filter_repository=args.filter_repository, source=args.overlay, ingress_host=args.ingress_host,
            engine_image=args.engine_image, control_plane_image=args.control_plane_image,
            allow_principals=tuple(args.allow_principal),
            ingress_principals=tuple(p.strip() for i in args.ingress_principal for p in i.split(",") if p.strip()),
            authz=args.authz,
            engine_selector=render.parse_engine_selector(args.engine_selector) if args.engine_selector else None,
            engine_ports=render.parse_engine_ports(args.engine_port), engine_service=args.engine_service,
            mesh_tls13=args.mesh_tls13, delivery=args.delivery, filter_host=args.filter,
            istio_version=args.istio_version, native_image=args.native_image)
        objects = render.render(opts)
        mcp = render.mcp_objects(objects, plugin_config)
    except (ValueError, FileNotFoundError, kustomize.KustomizeError) as exc:
        print(f"meshcache istio render: {exc}", file=sys.stderr)
        return 2
    if args.out is None:
        sys.stdout.write(kustomize.dump(objects))
        return 0
    for path in render.write(objects, render.render_operators(opts), mcp, args.out, opts):
        print(f"wrote {path}")
    print(render.install_steps(opts, args.out))
    print(render.mesh_changes(opts))
    return 0


def _xds_certs(args: argparse.Namespace) -> int:
    from . import xds_tls

    had_ca = (args.out / xds_tls.CA).exists()
    try:
        render.check_namespace(args.namespace)
        if args.drop_old_ca:
            written, stage = xds_tls.drop_old_ca(args.out), "drop"
        else:
            written = xds_tls.issue(args.namespace, args.out, days=args.days, new_ca=args.new_ca)
            stage = "rotate" if args.new_ca and had_ca else "renew" if had_ca else "first"
    except ValueError as exc:
        print(f"meshcache istio xds-certs: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    if stage == "renew":
        print(f"(reused the CA in {args.out / xds_tls.CA}: --new-ca starts a new one)")
    print(xds_tls.kubectl_commands(args.namespace, args.out, stage))
    return 0


def _oci_layout(args: argparse.Namespace) -> int:
    image = oci.image_for(args.module)
    oci.write_layout(image, args.out, args.tag)
    print(f"wrote {args.out}: sha256:{image.digest} (module sha256 {image.module_sha256})")
    return 0


def _validate(args: argparse.Namespace) -> int:
    from . import authz, crossref, validate

    try:
        validate.crd_file()
        files = validate.manifest_files(args.files)
        loaded = {f: validate.load_yaml_objects(f) for f in files}
        theirs = [o for f in args.workload for o in validate.load_yaml_objects(f)]
    except (FileNotFoundError, validate.ManifestError) as exc:
        print(f"meshcache istio validate: {validate.one_line(str(exc))}", file=sys.stderr)
        return 2
    per_file = {f: [o for o in objs if "apiVersion" in o or "kind" in o] for f, objs in loaded.items()}
    objects = [o for objs in per_file.values() for o in objs]
    errors = [f"{f}: {e}" for f, objs in per_file.items() for e in validate.validate_all(objs).errors]
    # Cross-file checks name objects (`Kind/name: ...`): each error is prefixed with its object's file.
    where = {validate.short_id(o): f for f, objs in per_file.items() for o in objs}
    found = []
    manifests = [o for o in objects if o["kind"] != "IstioOperator"]
    theirs = [i for o in theirs for i in (o.get("items", []) if o.get("kind") == "List" else [o])]
    where |= {validate.short_id(o): f for f in args.workload for o in theirs}
    # Who the AuthorizationPolicies would deny by surprise, on the workloads given (own or --workload).
    warned = authz.check_authorization(manifests + theirs)
    if args.module.exists():
        image = oci.image_for(args.module)
        startup = any(o["kind"] == "Deployment" and o["metadata"]["name"] == render.CONTROL_PLANE for o in manifests)
        allowed = frozenset(args.allow_principal)
        if startup and not render.own_engine(manifests) and not theirs:
            # In front of the user's servers: what selects them is checked only against them.
            found += crossref.check_delivery(manifests)
            print("cross-references of the cached workloads skipped: pass their manifests with --workload FILE "
                  "(e.g. `kubectl get deploy,svc NAME -o yaml`)")
            found += (crossref.check_module(manifests, image.digest) + crossref.check_startup(manifests)
                      + crossref.check_availability(manifests))
        else:
            # Partial sets (an MCP preview alone) skip the startup rules, which need the control plane.
            found += crossref.check_all(manifests + theirs, image.digest, startup=startup,
                                        allowed_principals=allowed)
    operators = [(f, o) for f, objs in per_file.items() for o in objs if o["kind"] == "IstioOperator"]
    # The fresh install's two steps carry a profile (step 1 the fewer sources); the existing-Istio
    # overlay has none and, like step 2, must add the control plane over TLS and keep k8s://.
    fresh = sorted(((f, o) for f, o in operators if "profile" in o["spec"]),
                   key=lambda fo: len(fo[1]["spec"].get("meshConfig", {}).get("configSources", [])))
    if len(fresh) == 2:
        (f1, step1), (f2, step2) = fresh
        errors += [f"{f1}, {f2}: {e}" for e in crossref.check_operator_steps(step1, step2)]
    for f, overlay in operators:
        if "profile" not in overlay["spec"]:
            errors += [f"{f}: {e}" for e in crossref.check_operator_steps({"spec": {}}, overlay)]
    errors += [f"{where[e.split(': ', 1)[0]]}: {e}" if e.split(": ", 1)[0] in where else e for e in found]
    warnings = [f"{where[w.split(': ', 1)[0]]}: warning: {w}" if w.split(": ", 1)[0] in where else f"warning: {w}"
                for w in warned]
    for e in [*errors, *warnings]:
        print(validate.one_line(e), file=sys.stderr)
    summary = f"{len(objects)} objects in {len(files)} files, {len(errors)} errors"
    print(summary + (f", {len(warnings)} warnings (exit status unchanged)" if warnings else ""))
    return 1 if errors else 0
