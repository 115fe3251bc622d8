-- The fresh-page counter (layout version 5): OS pages per second that a
-- refill wrote first, faulting them in; their time is left out of slow_ns
-- (the fault count prices it), summed over classes.
ALTER TABLE windows ADD COLUMN fresh_pages REAL NOT NULL DEFAULT 0;
