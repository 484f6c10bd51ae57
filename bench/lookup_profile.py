"""Where one API process spends a lookup's time: cProfile of the API under wrk's lookup load, for one or more
checkouts' trees. Prints, per tree, the process's CPU per request and the share of the profiled time under each
part of the path (HTTP layer, middleware, FastAPI's dependency and parameter solving, auth, the lookup's own work,
Redis), and writes JSON.

It starts its own redis-server, seeds `--models` models as bench/api_load.py does (auth on: a pull key of their
namespace), and runs one API process (uvicorn, httptools and uvloop when installed, as `aotc-server`) in this
process under cProfile, with `wrk -t1 -c32` (the Debian package) picking a random lookup per request. Each tree runs
in a child process of its own, so `--tree /work/main --tree .` compares main's code with this checkout's under the
same load, one after the other. cProfile slows Python several times, so the shares, not the rates, are the result.

    python bench/lookup_profile.py --tree /work/main --tree . --out bench/results/lookup-profile-2cores.json
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# Parts of the path, by where a function lives (file fragment, function name or None for any), in this order: a
# function's own time goes to the first part it matches; the rest is "other" (asyncio, the interpreter).
PARTS: list[tuple[str, str, str | None]] = [
    ("FastAPI solving", "fastapi/dependencies/", None),
    ("FastAPI solving", "fastapi/routing.py", None),
    ("FastAPI solving", "pydantic", None),
    ("FastAPI solving", "fastapi/", None),
    ("auth", "service/api/auth.py", None),
    ("auth", "service/api/security.py", None),
    ("lookup's own work", "service/api/lookup.py", None),
    ("lookup's own work", "service/api/cache.py", None),
    ("lookup's own work", "service/api/deps.py", None),
    ("lookup's own work", "urllib/parse.py", None),
    ("lookup's own work", "compiler/", None),
    ("Redis client", "redis/", None),
    ("middleware and routing", "starlette/", None),
    ("middleware and routing", "service/api/app.py", None),
    ("middleware and routing", "service/api/http.py", None),
    ("middleware and routing", "service/api/routes/metrics.py", None),
    ("middleware and routing", "service/api/errors.py", None),
    ("HTTP layer (uvicorn)", "uvicorn/", None),
    ("HTTP layer (uvicorn)", "httptools", None),
    ("HTTP layer (uvicorn)", "h11", None),
]


def _part(filename: str, func: str) -> str:
    for name, fragment, fn in PARTS:
        if fragment in filename and (fn is None or fn == func):
            return name
    return "other (asyncio, uvloop, builtins)"


def child(args: argparse.Namespace) -> None:
    """Runs in a process whose sys.path starts with the tree: serve under cProfile while wrk loads."""
    sys.path.insert(0, str(ROOT / "bench"))
    from api_load import NAMESPACE, seed  # type: ignore[import-not-found]

    sys.path.insert(0, str(args.tree))  # after api_load, which puts this checkout first
    import uvicorn
    from pydantic import SecretStr

    from service.api.app import create_app
    from service.api.http import protocol
    from service.api.settings import Settings
    from service.store import Store
    from service.store.embedded import EmbeddedRedis, free_port

    with tempfile.TemporaryDirectory(prefix="aotc-lookup-profile-") as tmp_s:
        tmp = Path(tmp_s)
        with EmbeddedRedis(tmp / "redis", appendonly=False) as redis_srv:
            store = Store(redis_srv.url)
            ids, _ = seed(store, args.models, tmp)
            key = store.apikeys.create("pull", NAMESPACE, "profile")[1]
            settings = Settings(redis_url=redis_srv.url, data_dir=tmp / "data",
                                admin_key=SecretStr(secrets.token_urlsafe(24)))
            port = free_port()
            paths = [f"/v1/artifacts/lookup?model_id={m}&target=cpu&shape=x=8x3x64x64" for m in ids]
            script = tmp / "paths.lua"
            script.write_text("local paths = {" + ",".join(json.dumps(p) for p in paths) + "}\n"
                              f'wrk.headers["Authorization"] = "Bearer {key}"\n'
                              "request = function() return wrk.format('GET', paths[math.random(#paths)]) end\n")
            api = create_app(settings)
            loops: list[asyncio.AbstractEventLoop] = []

            async def app(scope: Any, receive: Any, send: Any) -> None:  # notes the server's loop
                if not loops:
                    loops.append(asyncio.get_running_loop())
                await api(scope, receive, send)

            server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                                   log_level="warning", http=protocol(settings.http),
                                                   loop=settings.loop))
            prof = cProfile.Profile()
            out: dict[str, Any] = {}

            def load() -> None:
                while not server.started:
                    time.sleep(0.05)
                url = f"http://127.0.0.1:{port}"
                subprocess.run(["wrk", "-t1", "-c32", "-d2s", "-s", str(script), url], capture_output=True)  # warm
                cpu0 = time.process_time()
                # cProfile sees only the thread that enables it: the server's, on its own loop.
                loops[0].call_soon_threadsafe(prof.enable)
                res = subprocess.run(["wrk", "-t1", "-c32", f"-d{args.seconds}s", "-s", str(script), url],
                                     capture_output=True, text=True)
                done = threading.Event()

                def stop() -> None:
                    prof.disable()
                    done.set()

                loops[0].call_soon_threadsafe(stop)
                done.wait(10)
                out["cpu_s"] = time.process_time() - cpu0
                line = next(ln for ln in res.stdout.splitlines() if "requests in" in ln)
                out["requests"] = int(line.split()[0])
                out["wrk"] = res.stdout
                server.should_exit = True

            threading.Thread(target=load, daemon=True).start()
            server.run()
            store.close()
    stats = pstats.Stats(prof)
    parts: dict[str, float] = {}
    top = []
    for (filename, _line, func), (_cc, _nc, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        part = _part(filename, func)
        parts[part] = parts.get(part, 0.0) + tt
        top.append((tt, ct, f"{Path(filename).name}:{func}", part))
    total = sum(parts.values())
    top.sort(reverse=True)
    import service

    result = {"tree": str(args.tree), "service_from": service.__file__, "requests": out["requests"],
              "server_cpu_s": round(out["cpu_s"], 3),
              "server_cpu_us_per_request_profiled": round(out["cpu_s"] / out["requests"] * 1e6, 1),
              "profiled_s": round(total, 3),
              "parts": {k: round(v / total, 4) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])},
              "top_tottime": [{"function": name, "part": part, "tottime_s": round(tt, 4), "cumtime_s": round(ct, 4)}
                              for tt, ct, name, part in top[:25]]}
    args.result.write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tree", action="append", type=Path, help="a checkout (repeat to compare); default: this one")
    ap.add_argument("--models", type=int, default=2000)
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.tree = args.tree[0]
        child(args)
        return
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(),
                               "loadavg_before": os.getloadavg(), "models": args.models, "seconds": args.seconds,
                               "trees": []}
    for tree in [t.resolve() for t in (args.tree or [ROOT])]:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            env = {**os.environ, "PYTHONPATH": str(tree)}
            subprocess.run([sys.executable, __file__, "--child", "--tree", str(tree), "--models", str(args.models),
                            "--seconds", str(args.seconds), "--out", str(args.out), "--result", f.name],
                           env=env, cwd=tree, check=True)
            r = json.loads(Path(f.name).read_text())
        results["trees"].append(r)
        print(f"\n{tree}: {r['requests']} lookups profiled, {r['server_cpu_us_per_request_profiled']} us of the "
              f"API process's CPU per lookup (under cProfile)")
        print(f"{'part':40s} {'share':>6s}")
        for part, share in r["parts"].items():
            print(f"{part:40s} {share * 100:5.1f}%")
        print(f"{'function (top 12 by own time)':48s} {'part':26s} {'own s':>7s} {'cum s':>7s}")
        for t in r["top_tottime"][:12]:
            print(f"{t['function'][:48]:48s} {t['part'][:26]:26s} {t['tottime_s']:7.3f} {t['cumtime_s']:7.3f}")
    results["loadavg_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
