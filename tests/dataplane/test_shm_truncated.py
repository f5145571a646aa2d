"""A client that shrinks its system shared-memory object after registering it gets a clear 400
(gRPC INVALID_ARGUMENT) instead of a server killed by SIGBUS, for inputs and outputs alike.

The server runs in a child process: without the guard, touching the shrunk mapping kills the
process that holds the server, and that must fail this test, not end the pytest run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    '''
    import json, os, sys, tempfile, uuid
    from pathlib import Path

    import httpx
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from pyserve import InferResponse
    from pyserve.api.backend import Backend
    from pyserve.testing import serve, write_model

    CONFIG = """
    name: "addsub"
    backend: "shmtrunc"
    input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 16 ] },
            { name: "INPUT1" data_type: TYPE_INT32 dims: [ 16 ] } ]
    output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 16 ] } ]
    """

    class AddSub(Backend):
        def execute(self, instance, requests):
            return [InferResponse({"OUTPUT0": r.inputs["INPUT0"] + r.inputs["INPUT1"]}) for r in requests]

    def body(in_params=None, out_params=None):
        first = {"name": "INPUT0", "datatype": "INT32", "shape": [16]}
        if in_params is None:
            first["data"] = list(range(16))
        else:
            first["parameters"] = in_params
        result = {"inputs": [first, {"name": "INPUT1", "datatype": "INT32", "shape": [16], "data": [1] * 16}]}
        if out_params is not None:
            result["outputs"] = [{"name": "OUTPUT0", "parameters": out_params}]
        return result

    def answer(response):
        try:
            return [response.status_code, response.json()]
        except ValueError:
            return [response.status_code, response.text]

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        write_model(repo, "addsub", CONFIG)
        key = f"/pyserve_trunc_{uuid.uuid4().hex[:12]}"
        fd = os.open("/dev/shm/" + key[1:], os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, 8192)
            os.pwrite(fd, np.arange(16, dtype=np.int32).tobytes(), 4096)
            with serve(repo, backends={"shmtrunc": AddSub()}) as server, \\
                    httpx.Client(base_url=f"http://{server.url}", timeout=30) as http:
                reg = http.post("/v2/systemsharedmemory/region/r/register", json={"key": key, "byte_size": 8192})
                results["register"] = answer(reg)
                window = {"shared_memory_region": "r", "shared_memory_offset": 4096, "shared_memory_byte_size": 64}
                results["before"] = answer(http.post("/v2/models/addsub/infer", json=body(window)))
                os.ftruncate(fd, 100)  # the client shrinks its object below the window
                results["input"] = answer(http.post("/v2/models/addsub/infer", json=body(window)))
                results["output"] = answer(http.post("/v2/models/addsub/infer", json=body(None, window)))
                # a window still inside the shrunk object keeps working
                inside = {"shared_memory_region": "r", "shared_memory_byte_size": 64}
                results["inside"] = answer(http.post("/v2/models/addsub/infer", json=body(None, inside)))
                client = grpcclient.InferenceServerClient(server.grpc_url)
                try:
                    tensor = grpcclient.InferInput("INPUT0", [16], "INT32")
                    tensor.set_shared_memory("r", 64, offset=4096)
                    other = grpcclient.InferInput("INPUT1", [16], "INT32")
                    other.set_data_from_numpy(np.ones(16, dtype=np.int32))
                    try:
                        client.infer("addsub", [tensor, other])
                        results["grpc"] = ["OK", ""]
                    except InferenceServerException as exc:
                        results["grpc"] = [exc.status(), exc.message()]
                finally:
                    client.close()
                results["after"] = answer(http.post("/v2/models/addsub/infer", json=body()))
        finally:
            os.close(fd)
            os.unlink("/dev/shm/" + key[1:])
    print("RESULTS " + json.dumps(results))
    '''
)


def test_shrunk_region_is_refused_and_server_survives() -> None:
    child = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, f"server process exited with {child.returncode}: {child.stderr[-2000:]}"
    line = next(x for x in child.stdout.splitlines() if x.startswith("RESULTS "))
    results = json.loads(line.removeprefix("RESULTS "))

    assert results["register"][0] == 200
    assert results["before"][0] == 200
    for case in ("input", "output"):
        status, answer = results[case]
        assert status == 400, (case, answer)
        assert "shrunk after registration" in answer["error"] and "region 'r'" in answer["error"], answer
    assert "INPUT0" in results["input"][1]["error"]
    assert "OUTPUT0" in results["output"][1]["error"]
    assert results["inside"][0] == 200, results["inside"]
    status, message = results["grpc"]
    assert status == "StatusCode.INVALID_ARGUMENT" and "shrunk after registration" in message, results["grpc"]
    assert results["after"][0] == 200
    assert results["after"][1]["outputs"][0]["data"] == [i + 1 for i in range(16)]
