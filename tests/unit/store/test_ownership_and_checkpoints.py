"""One server per data directory (and database); versioned checkpoint directories and their sweep."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from server.store.checkpoints import TinkerPath, remove_checkpoint_files, sweep_unlisted_versions
from server.store.ownership import AlreadyServed, Ownership
from server.store.store import Store


def test_a_second_holder_of_a_data_directory_or_database_is_refused_until_the_first_lets_go(tmp_path, database_url):
    data_dir = tmp_path / "data"
    first_store, second_store = Store(database_url), Store(database_url)
    try:
        first = Ownership(data_dir, first_store.engine)
        with pytest.raises(AlreadyServed, match="another server"):
            Ownership(data_dir, second_store.engine)
        if database_url.startswith("postgresql"):  # the database alone is held too
            with pytest.raises(AlreadyServed, match="database"):
                Ownership(tmp_path / "other-data", second_store.engine)
        first.release()
        Ownership(data_dir, second_store.engine).release()
    finally:
        first_store.close()
        second_store.close()


def test_a_journal_reached_by_another_path_or_url_is_held_whatever_data_directory_names_it(tmp_path, database_url):
    first_dir = tmp_path / "first"
    first_dir.mkdir()
    (tmp_path / "link").symlink_to(first_dir, target_is_directory=True)
    if database_url.startswith("sqlite"):
        # The first server's own journal (in its data directory), named through a symbolic link.
        first_url, second_url = f"sqlite:///{first_dir}/server.db", f"sqlite:///{tmp_path}/link/server.db"
    else:  # the same database by another spelling of its URL
        first_url, second_url = database_url, f"{database_url}?application_name=second"
    first_store, second_store = Store(first_url), Store(second_url)
    try:
        first = Ownership(first_dir, first_store.engine)
        with pytest.raises(AlreadyServed, match="already uses the database"):
            Ownership(tmp_path / "second", second_store.engine)
        first.release()
        Ownership(tmp_path / "second", second_store.engine).release()
    finally:
        first_store.close()
        second_store.close()


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    data_dir = tmp_path / "data"
    database_url = f"sqlite:///{tmp_path}/journal.db"
    Store(database_url).close()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from server.store.ownership import Ownership
        from server.store.store import Store
        held = Ownership(Path({str(data_dir)!r}), Store({database_url!r}).engine)
        print("held", flush=True)
        time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[3])
    try:
        assert holder.stdout.readline().strip() == "held"
        store = Store(database_url)
        with pytest.raises(AlreadyServed, match=f"pid {holder.pid}"):
            Ownership(data_dir, store.engine)
        holder.kill()  # kill -9: the operating system releases the lock
        holder.wait()
        Ownership(data_dir, store.engine).release()
        store.close()
    finally:
        holder.kill()


def test_each_save_gets_a_new_version_directory_and_unlisted_versions_are_swept(tmp_path):
    checkpoint_dir = tmp_path / "checkpoints"
    path = TinkerPath("s:train:0", "weights", "keep")
    listed, leftover = path.new_version_directory(checkpoint_dir), path.new_version_directory(checkpoint_dir)
    assert listed != leftover and listed.parent == leftover.parent == checkpoint_dir / "s:train:0" / "weights" / "keep"
    for directory in (listed, leftover):
        directory.mkdir(parents=True)
        (directory / "adapter_model.safetensors").write_bytes(b"x")
    legacy = checkpoint_dir / "s:train:0" / "sampler_weights" / "old"  # a checkpoint saved before versions
    (legacy / "v-notaversion").mkdir(parents=True)

    assert sweep_unlisted_versions(checkpoint_dir, {str(listed), str(legacy)}) == 1
    assert listed.exists() and not leftover.exists() and (legacy / "v-notaversion").exists()

    remove_checkpoint_files(listed, checkpoint_dir)
    assert not (checkpoint_dir / "s:train:0" / "weights").exists() and checkpoint_dir.exists()
