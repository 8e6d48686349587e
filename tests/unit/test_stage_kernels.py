"""Stage kernels started at the same moment, as two runs of one checkout start them, each answer their own run."""

import asyncio
import os
import tempfile

from eagle3lib.workbook.kernels import stage_kernel_manager


async def _started_together_then_asked(managers):
    """Each manager's kernel pid and the pid that answered its client, the kernels started at the same moment."""
    try:
        await asyncio.gather(*(km.start_kernel() for km in managers))
        pairs = []
        for km in managers:
            client = km.client()
            client.start_channels()
            try:
                await client.wait_for_ready(timeout=60)
                reply = await client.execute_interactive("import os", user_expressions={"pid": "os.getpid()"})
                answered = int(reply["content"]["user_expressions"]["pid"]["data"]["text/plain"])
                pairs.append((km.provisioner.pid, answered))
            finally:
                client.stop_channels()
        return pairs
    finally:
        await asyncio.gather(*(km.shutdown_kernel(now=True) for km in managers if km.has_kernel))


def test_kernels_started_together_answer_their_own_clients(tmp_path, monkeypatch):
    """jupyter_client's IPC sockets are kernel-ipc-N in the working directory (papermill's: the notebooks folder,
    shared by every run of a checkout): kernels started together bound the same paths, and of three, two clients
    spoke to the third kernel and waited for a reply until the start timeout ("Kernel didn't respond", the words of
    a training lost that way)."""
    monkeypatch.chdir(tmp_path)
    managers = [stage_kernel_manager()(kernel_name="python3") for _ in range(3)]
    pairs = asyncio.run(_started_together_then_asked(managers))
    assert len(pairs) == 3 and all(own == answered for own, answered in pairs), pairs
    assert not list(tmp_path.iterdir())  # nothing bound in the working directory
    socket_dirs = [km.socket_dir for km in managers]
    assert len(set(socket_dirs)) == 3
    assert not any(os.path.exists(d) for d in socket_dirs)  # removed at shutdown


def test_a_long_temp_folder_still_gives_a_kernel_that_answers(tmp_path, monkeypatch):
    """A cluster job's TMPDIR can be long; a socket's path ends at 107 bytes."""
    long_tmp = tmp_path / ("x" * 60) / ("y" * 60)
    long_tmp.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))
    km = stage_kernel_manager()(kernel_name="python3")
    [(own, answered)] = asyncio.run(_started_together_then_asked([km]))
    assert own == answered
    assert len(os.path.join(km.socket_dir, "kernel-5")) < 108
