package kvevents

import (
	"context"
	"io"
	"net"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4/transport"
	"github.com/stretchr/testify/require"
)

// TestConnClosesWithSocket: a connection the buffered transport dials or
// accepts closes when its socket's context is done, whether or not zmq4
// closes it (one that joins a closing socket is not closed by zmq4): the
// peer reads the end.
func TestConnClosesWithSocket(t *testing.T) {
	tcp := bufTransport{transport.New("tcp")}
	tests := []struct {
		name string
		// connect returns the transport's end, made under ctx, and the
		// peer's.
		connect func(t *testing.T, ctx context.Context) (ours, peer net.Conn)
	}{
		{name: "dialled", connect: func(t *testing.T, ctx context.Context) (net.Conn, net.Conn) {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			require.NoError(t, err)
			defer l.Close()
			ours, err := tcp.Dial(ctx, &net.Dialer{}, l.Addr().String())
			require.NoError(t, err)
			peer, err := l.Accept()
			require.NoError(t, err)
			return ours, peer
		}},
		{name: "accepted", connect: func(t *testing.T, ctx context.Context) (net.Conn, net.Conn) {
			l, err := tcp.Listen(ctx, "127.0.0.1:0")
			require.NoError(t, err)
			defer l.Close()
			peer, err := net.Dial("tcp", l.Addr().String())
			require.NoError(t, err)
			ours, err := l.Accept()
			require.NoError(t, err)
			return ours, peer
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(t.Context())
			ours, peer := tt.connect(t, ctx)
			defer ours.Close()
			defer peer.Close()

			_, err := peer.Write([]byte("ab"))
			require.NoError(t, err)
			buf := make([]byte, 2)
			_, err = io.ReadFull(ours, buf)
			require.NoError(t, err, "open while the socket is")
			require.Equal(t, "ab", string(buf))

			cancel()
			require.NoError(t, peer.SetReadDeadline(time.Now().Add(10*time.Second)))
			_, err = peer.Read(buf)
			require.ErrorIs(t, err, io.EOF, "the socket's end closed with its context")
		})
	}
}

// TestConnClosedOnce: a connection closed before its socket leaves
// nothing to close when the socket's context ends.
func TestConnClosedOnce(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	c, err := bufTransport{transport.New("tcp")}.Dial(ctx, &net.Dialer{}, l.Addr().String())
	require.NoError(t, err)
	peer, err := l.Accept()
	require.NoError(t, err)
	defer peer.Close()
	require.NoError(t, c.Close())
	require.False(t, c.(*bufConn).stop(), "the close on the context's end was withdrawn")
}
