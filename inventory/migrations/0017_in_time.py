"""`inventory_in_time(until)`: raise when a sale statement runs past its checkout's deadline.

A checkout's deadline bounds its waits on the client's side (`inventory.deadline`), and a row
lock's wait inside a statement (`lock_timeout`). Neither bounds a statement the database holds
without waiting on a lock: one sent just before PostgreSQL stopped (SIGSTOP, a paused VM, a
host swapping) runs when it wakes, and would commit a sale its buyer is no longer waiting for.
Each sale statement ends with this check, against the deadline as a time of day: past it, the
statement aborts and PostgreSQL undoes every row it wrote. SQLSTATE FS002 lets the caller tell
it from a real error. NULL: no deadline (a command, a task).
"""

from django.db import migrations

CREATE = """
CREATE OR REPLACE FUNCTION inventory_in_time(until timestamptz)
RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    IF until IS NOT NULL AND clock_timestamp() > until THEN
        RAISE EXCEPTION 'the checkout''s deadline passed % ago', clock_timestamp() - until
            USING ERRCODE = 'FS002';
    END IF;
    RETURN true;
END
$$;
"""

DROP = "DROP FUNCTION IF EXISTS inventory_in_time(timestamptz);"


class Migration(migrations.Migration):
    dependencies = [("inventory", "0016_salerepair")]

    operations = [migrations.RunSQL(CREATE, DROP)]
