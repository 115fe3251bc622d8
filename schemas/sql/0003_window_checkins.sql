-- The check-in counter (layout version 3): thread-cache bins whose
-- allocation countdown ran out, per second, summed over classes.
ALTER TABLE windows ADD COLUMN checkins REAL NOT NULL DEFAULT 0;
