package dedup

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"
)

// Checkpoint records, inside the caller's transaction and fenced by the
// lease token, that step name is committed, with optional data for later
// steps. Step is the usual way to call it.
func (s *Store) Checkpoint(ctx context.Context, tx pgx.Tx, l *Lease, name string, data []byte) error {
	if l.held {
		return errHeld("checkpoint " + name)
	}
	tag, err := tx.Exec(ctx, s.sql.checkpoint, l.Consumer, l.Tenant, l.stored, l.Token, name, data)
	if err != nil {
		return interpretError("checkpoint "+name, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("checkpoint %s: %w", name, ErrLeaseLost)
	}
	return nil
}

// Step runs one atomic phase of a multi-step operation: fn runs in its own
// transaction, which commits together with the recovery point name (fenced
// by the lease). If an earlier attempt already committed step name, fn is not
// run again: a retry resumes after the last committed step. Step names must
// be unique within an operation. A lease that no longer holds its key (taken
// over, released) or whose time ran out (its heartbeat stalled: another
// worker may take the key over at any moment) does not start fn: Step
// returns ErrLeaseLost first. The check takes no lock, so a lease lost
// while fn runs is found by the checkpoint, which rolls fn's transaction
// back; an external call in fn needs DerivedKey for that case.
//
// Work that touches another system inside fn should pass l.DerivedKey(name)
// to it, so that the other system's own deduplication recognises a retry of
// a step whose transaction did not commit.
func (s *Store) Step(ctx context.Context, l *Lease, name string, fn func(ctx context.Context, tx pgx.Tx) error) error {
	if l.StepDone(name) {
		return nil
	}
	if l.held {
		// Its own transaction would wait for the row the caller's holds.
		return errHeld("step " + name)
	}
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if err := s.stillHeld(ctx, tx, l); err != nil {
			return err
		}
		if err := fn(ctx, tx); err != nil {
			return err
		}
		return s.Checkpoint(ctx, tx, l, name, nil)
	})
	if err != nil {
		return fmt.Errorf("step %s: %w", name, err)
	}
	l.Steps = append(l.Steps, name)
	l.RecoveryPoint = name
	return nil
}

// StepDone reports whether step name was committed, by this attempt or an
// earlier one.
func (l *Lease) StepDone(name string) bool { return slices.Contains(l.Steps, name) }

// stillHeld returns ErrLeaseLost when l no longer holds its key or its time
// ran out. It locks nothing: the heartbeat's extension of the row must not
// wait for a step.
func (s *Store) stillHeld(ctx context.Context, tx pgx.Tx, l *Lease) error {
	var held bool
	err := tx.QueryRow(ctx, s.sql.holds, l.Consumer, l.Tenant, l.stored, l.Token).Scan(&held)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return ErrLeaseLost
	case err != nil:
		return interpretError("check lease", err)
	}
	return nil
}
