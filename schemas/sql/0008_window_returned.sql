-- Layout version 6: what the program's own threads give back to the OS, and
-- the memory calls made by the decay thread beside them (per second, like
-- every counter). learnd prices the pages a program's thread gives back and
-- leaves the decay thread's calls out of the program's time (objective.py).
ALTER TABLE windows ADD COLUMN decay_syscalls REAL NOT NULL DEFAULT 0;
ALTER TABLE windows ADD COLUMN returned_bytes REAL NOT NULL DEFAULT 0;
